"""Write a tiny DeepSeek-V4 checkpoint in the exact original on-disk format.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--variant flash|0731|vision] [--seed N]
                                           [--small-vocab]

Same tensor names, dtypes, shape rules, shard layout, index and config keys as the real
DeepSeek-V4-Flash (or -0731, or -Vision-Exp) repository; small dimensions (see
backfit/synthetic.py and backfit/synthetic_vision.py).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backfit.synthetic import write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--variant", choices=["flash", "0731", "vision"], default="flash")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small-vocab", action="store_true",
                    help="512-id byte-level tokenizer instead of the real 129,280-id one (faster)")
    a = ap.parse_args()
    out = Path(a.out_dir)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} exists and is not empty")
    t = time.time()
    write_checkpoint(out, a.variant, seed=a.seed, small_vocab=a.small_vocab)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {a.variant} checkpoint to {out}: {size / 1e6:.1f} MB in {time.time() - t:.1f} s")


if __name__ == "__main__":
    main()
