"""Sorted fused-MoE tile configs (int8_mx32, real Flash dims: 256 experts 2048x4096, top-6) on the
lent GPU, each config's time and error against the default config's output:

    python3 scripts/sweep_moe_sorted.py

M = 32, 64 (batch-32/64 decode, CUDA-graph timed, % of copy bandwidth for the distinct experts'
bytes) and M = 256 ... 8192 (prefill, CUDA events, TFLOP/s); configs (BM, BN, BK, warps, stages
[, DEQ]). The session-8 figures in kernels.moe._sorted_config come from the first version of this
sweep (M = 2048 and 8192, DEQ 0 only); the M = 32/64 and DEQ 1 rows have not run yet.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from backfit.runtime.kernels import moe  # noqa: E402

E, D, I, K = 256, 4096, 2048, 6
SMALL = [None, (16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 256, 4, 2), (16, 32, 256, 4, 3),
         (16, 128, 64, 4, 4), (16, 64, 128, 4, 4), (16, 256, 128, 8, 3), (16, 64, 128, 4, 3, 1),
         (16, 128, 128, 4, 3, 1), (16, 64, 256, 4, 2, 1), (16, 32, 256, 4, 3, 1), (32, 64, 128, 4, 3)]
LARGE = [None, (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 4),
         (256, 64, 64, 8, 3), (256, 64, 64, 8, 4), (256, 32, 64, 4, 3), (256, 64, 32, 8, 4),
         (128, 64, 64, 8, 3), (64, 64, 128, 4, 3), (32, 128, 64, 4, 4), (64, 128, 32, 4, 4),
         (32, 64, 64, 4, 4), (16, 64, 128, 4, 3), (64, 128, 64, 4, 4, 1), (64, 64, 64, 4, 4, 1),
         (256, 64, 64, 8, 3, 1), (128, 64, 64, 4, 4, 1), (256, 64, 64, 8, 4, 1),
         (32, 128, 64, 4, 4, 1), (16, 64, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1)]


def config(c) -> dict | None:
    if c is None:
        return None
    cfg = dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4])
    if len(c) > 5:
        cfg["DEQ"] = c[5]
    return cfg


def main() -> None:
    st = (*bk.mx_stack(E, I, D), *bk.mx_stack(E, I, D), *bk.mx_stack(E, D, I))
    for M in (32, 64, 256, 1024, 2048, 4096, 8192):
        x = torch.randn(M, D, device="cuda").bfloat16()
        idx = torch.rand(M, E, device="cuda").argsort(1)[:, :K]
        w = torch.rand(M, K, device="cuda")
        ref = moe.fused_moe(x, idx, w, *st, 10.0, path="sorted")
        nexp = int(idx.unique().numel())
        byts = nexp * 3 * I * D * (1 + 1 / 32)                     # codes + exponent bytes
        flops = 2 * M * K * 3 * I * D
        for c in SMALL if M <= 64 else LARGE:
            if c and M <= 1024 and c[0] > 64:
                continue
            cfg = config(c)
            fn = lambda cfg=cfg: moe.fused_moe(x, idx, w, *st, 10.0, path="sorted",  # noqa: E731
                                               config=cfg)
            try:
                err = ((fn() - ref).norm() / ref.norm()).item()
                if M <= 64:
                    us = bk.graph_us([fn])
                    print(f"M={M} {c}: {us:8.1f} us  {byts / us / 1e6:6.0f} GB/s ({nexp} experts)"
                          f"  rel {err:.1e}", flush=True)
                else:
                    ms = bk.events_ms(fn, 5)
                    print(f"M={M} {c}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  rel {err:.1e}",
                          flush=True)
            except Exception as e:                                  # e.g. out of shared memory
                print(f"M={M} {c}: {type(e).__name__} {str(e)[:80]}", flush=True)


if __name__ == "__main__":
    main()
