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


def test_bench_vision_tiny_dry_run(tmp_path):
    """scripts/bench_vision.py --tiny (the CPU dry run of the GPU benchmark): both parts run
    through the runtime and the engine as the real-dims run does, and write their rows."""
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench_vision.py"), "--tiny",
                        "--sizes", "384x384", "--images", "1,2", "--image-size", "64x48",
                        "--json", str(tmp_path / "v.json")], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root)))
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["tower"][0]["vit_grid"] == "28x28" and out["tower"][0]["tower_ms"] > 0
    assert [row["images"] for row in out["ttft"]] == [1, 2]
    assert out["ttft"][1]["image_positions"] > 2 * 98 and out["ttft"][1]["ttft_ms"] > 0
