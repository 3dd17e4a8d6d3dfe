"""`backfit demo`: the main job on the built-in tiny checkpoint, on any CPU-only machine."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

__all__ = ["run_demo"]


def run_demo(workdir: str | None = None) -> None:
    from backfit.convert.run import convert
    from backfit.synthetic import write_checkpoint

    root = Path(workdir or os.environ.get("BACKFIT_CACHE", Path.home() / ".cache" / "backfit")) / "demo"
    if workdir:
        root = Path(workdir)
    src, dst = root / "original", root / "converted-tp4"
    print(f"[1/2] writing a tiny DeepSeek-V4-Flash checkpoint in the exact original format to {src}")
    print("      (FP8 e4m3 linears with 128x128 UE8M0 scales, MXFP4 experts, real tokenizer)")
    t = time.time()
    if src.exists():
        shutil.rmtree(src)
    write_checkpoint(src, "flash", seed=0)
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"      {len(list(src.glob('*.safetensors')))} shards, {size / 1e6:.1f} MB, {time.time() - t:.1f} s")
    print(f"[2/2] backfit convert {src} {dst} --tp 4 --force")
    t = time.time()
    m = convert(src, dst, tp=4, force=True)
    print(f"      done in {time.time() - t:.1f} s; manifest: {dst / 'manifest.json'} "
          f"({len(m['tensors'])} tensors)")
    print("\nNext (not built yet): runtime, serve and verify on this converted directory.")
