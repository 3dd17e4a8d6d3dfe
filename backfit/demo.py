"""`backfit demo`: the whole flow on the built-in tiny checkpoint, on any CPU-only machine.

original checkpoint -> convert (INT8, tp 4; and a lossless BF16 copy) -> verify -> generate
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

__all__ = ["run_demo"]

PROMPT = "The harbour town woke slowly that morning."


def _step(n: int, text: str) -> float:
    print(f"\n[{n}/5] {text}", flush=True)
    return time.time()


def run_demo(workdir: str | None = None, max_positions: int = 512, max_tokens: int = 24) -> dict:
    from backfit.convert.run import convert
    from backfit.engine.sampling_params import SamplingParams
    from backfit.generate import generate
    from backfit.synthetic import write_checkpoint
    from backfit.verify.run import verify

    root = Path(workdir) if workdir else \
        Path(os.environ.get("BACKFIT_CACHE", Path.home() / ".cache" / "backfit")) / "demo"
    src, int8, lossless = root / "original", root / "converted-int8-tp4", root / "converted-bf16-tp1"
    t = _step(1, f"writing a tiny DeepSeek-V4-Flash checkpoint in the exact original format to {src}")
    print("      FP8 e4m3 linears with 128x128 UE8M0 scales, MXFP4 experts, the real tokenizer")
    if src.exists():
        shutil.rmtree(src)
    write_checkpoint(src, "flash", seed=0)
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"      {len(list(src.glob('*.safetensors')))} shards, {size / 1e6:.1f} MB, {time.time() - t:.1f} s")

    t = _step(2, f"backfit convert {src} {int8} --tp 4 --force   (the default INT8 format)")
    convert(src, int8, tp=4, force=True, progress=False)
    print(f"      {time.time() - t:.1f} s")
    t = _step(3, f"backfit convert {src} {lossless} --tp 1 --linears bf16 --experts bf16 --force")
    convert(src, lossless, tp=1, linears="bf16", experts="bf16", force=True, progress=False)
    print(f"      {time.time() - t:.1f} s")

    t = _step(4, "backfit verify: runtime on the converted dirs vs the reference on the original")
    print("\n--- semantics: lossless conversion, float32 activations ---")
    sem = verify(src, lossless, max_positions=max_positions)
    print("\n--- conversion: INT8 conversion (tp 4), float32 activations ---")
    conv = verify(src, int8, max_positions=max_positions)
    print(f"      {time.time() - t:.1f} s")

    t = _step(5, f"backfit generate {int8} --prompt {PROMPT!r} --max-tokens {max_tokens}")
    print(f"      (random weights: the text is gibberish, the point is that it runs)\n{PROMPT}", end="")
    generate(int8, [PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0,
                                            skip_special_tokens=False))
    print(f"      {time.time() - t:.1f} s")
    verdict = {True: "PASS", False: "FAIL"}
    print(f"\nsemantics check {verdict[sem['ok']]}; conversion check {verdict[conv['ok']]} "
          "(thresholds: docs/VERIFICATION.md)")
    return {"semantics": sem, "conversion": conv}
