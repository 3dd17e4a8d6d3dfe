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


def test_bench_engine_shared_prefix_dry_run(tiny_converted):
    """bench_engine.py --shared-prefix on the tiny model (the CPU dry run of the GPU step in
    gpu_check.sh): the warm session reuses the 200-token prefix up to the hint's block boundary
    (blocks of 64: 192), or without the hint up to the last periodic snapshot (a 128-token
    budget: every 128 tokens)."""
    import bench_engine
    from support import one_thread
    with one_thread():
        rows = bench_engine.main(["--model", str(tiny_converted(1, "int8")), "--dtype", "float32",
                                  "--shared-prefix", "200", "--prompt-len", "70",
                                  "--output-len", "2", "--reps", "1",
                                  "--max-num-batched-tokens", "128"])
    assert [(r["mode"], r["warm_cached_tokens"]) for r in rows] == [("hint", 192),
                                                                    ("periodic", 128)]
    assert all(r["ttft_cold_ms"] > 0 and r["ttft_warm_ms"] > 0 for r in rows)
