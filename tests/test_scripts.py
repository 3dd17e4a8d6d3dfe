"""The GPU benchmarks run only on the lent machine; what of them can break on a refactor without
a GPU is checked here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_bench_decode_profile_targets_exist():
    """bench_decode.py's profiler wraps runtime methods by name; a renamed one (Attention._attend,
    moved in 746676a) crashed the benchmark on the H200 after its decode rows."""
    import bench_decode

    for owner, attr, label in bench_decode.profile_targets():
        assert callable(getattr(owner, attr, None)), f"{owner.__name__}.{attr} ({label})"
