"""Sorted fused-MoE tile configs (int8_mx32, real Flash dims: 256 experts 2048x4096, top-6) on the
lent GPU, each config's time and error against the default config's output:

    python3 benchmarks/kernels/sweep_moe_sorted.py [--m 1024,8192] [--proj both|up|down] [--tp-shard
    4]
                                        [--out FILE]

M = 32, 64 (batch-32/64 decode, CUDA-graph timed, % of copy bandwidth for the distinct experts'
bytes) and M = 256 ... 8192 (prefill, CUDA events, TFLOP/s); configs (BM, BN, BK, warps,
stages), each with the default dequantization (moe.common.SORTED_DEQ: DEQ 2 since 2026-12-04). The
2026-12-01 figures in kernels.moe.int8._sorted_config come from the first version of this sweep (M =
2048 and 8192, DEQ 0). --proj up / down (int8 only): vary only the gate/up launch's tile (the
down launch keeps the default's BN, BK, warps, stages) or only the down launch's ("down" dict of
the config; BM stays the default's, the alignment both launches share): the two can then be
picked apart. --tp-shard N: the experts one TP-N rank holds (intermediate 2048 / N); --experts
mx4: the mx4_e2m1 stacks (kernels.moe.mx4's sorted kernel). --deq 0,2: only the default tiles,
once per dequantization (the sorted kernels' DEQ, both launches).
Prefill rows also print the bandwidth for the distinct experts' bytes (every expert is hit from
M ~ 256 on, and the small-M prefill of a TP-4 rank streams them all).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from backfit.runtime.kernels import moe  # noqa: E402

E, D, I, K = 256, 4096, 2048, 6
SMALL = [None, (16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 256, 4, 2), (16, 32, 256, 4, 3),
         (16, 128, 64, 4, 4), (16, 64, 128, 4, 4), (16, 256, 128, 8, 3), (32, 64, 128, 4, 3)]
LARGE = [None, (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 4),
         (256, 64, 64, 8, 3), (256, 64, 64, 8, 4), (256, 32, 64, 4, 3), (256, 64, 32, 8, 4),
         (128, 64, 64, 8, 3), (64, 64, 128, 4, 3), (32, 128, 64, 4, 4), (64, 128, 32, 4, 4),
         (32, 64, 64, 4, 4), (16, 64, 128, 4, 3)]

# 64 < M <= 1024 (a TP-4 rank's short prefill: ~M·6/256 tokens an expert, every expert
# streamed): LARGE's BM <= 64 rows, SMALL's and these (deeper pipelines, wider K steps)
MID = [(16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (16, 64, 256, 4, 3), (32, 128, 128, 8, 3),
       (16, 256, 64, 4, 4), (32, 64, 256, 4, 3), (16, 128, 256, 8, 3)]

# per-projection candidates at prefill sizes (--proj up|down): (BN, BK, warps, stages)
PROJ = [None, (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 32, 8, 4),
        (256, 64, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (32, 64, 4, 4), (64, 64, 8, 4),
        (128, 64, 8, 4)]


def config(c, proj: str = "both", M: int = 0) -> dict | None:
    if c is None:
        return None
    if proj != "both":                   # one launch's tile, the other keeps the default
        t = dict(BN=c[0], BK=c[1], num_warps=c[2], num_stages=c[3])
        if proj == "down":
            return dict(down=t)
        base = moe.common.sorted_pair(M * K, None)[1]                  # the default down tile
        return dict(t, down={k: base[k] for k in ("BN", "BK", "num_warps", "num_stages")})
    return dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="32,64,256,1024,2048,4096,8192", help="token counts")
    ap.add_argument("--proj", default="both", choices=("both", "up", "down"))
    ap.add_argument("--tp-shard", type=int, default=1, help="intermediate 2048 / N")
    ap.add_argument("--experts", choices=("int8", "mx4"), default="int8",
                    help="mx4: mx4_e2m1 stacks (kernels.moe.mx4; DEQ 0, 2)")
    ap.add_argument("--deq", help="comma list: the default tiles with each DEQ")
    ap.add_argument("--out", help="JSON of every row")
    a = ap.parse_args()
    global I
    I = 2048 // a.tp_shard
    rows = []
    stack = bk.mx4_stack if a.experts == "mx4" else bk.mx_stack
    st = (*stack(E, I, D), *stack(E, I, D), *stack(E, D, I))
    per_weight = 0.5 if a.experts == "mx4" else 1.0              # bytes a code
    for M in (int(m) for m in a.m.split(",")):
        x = torch.randn(M, D, device="cuda").bfloat16()
        idx = torch.rand(M, E, device="cuda").argsort(1)[:, :K]
        w = torch.rand(M, K, device="cuda")
        ref = moe.fused_moe(x, idx, w, *st, 10.0, path="sorted")
        nexp = int(idx.unique().numel())
        byts = nexp * 3 * I * D * (per_weight + 1 / 32)            # codes + exponent bytes
        flops = 2 * M * K * 3 * I * D
        cands = SMALL if M <= 64 else LARGE if a.proj == "both" else PROJ
        if 64 < M <= 1024 and a.proj == "both":
            cands = LARGE + [c for c in SMALL + MID if c and c not in LARGE]
        if a.deq:
            cands = [("DEQ", int(d)) for d in a.deq.split(",")]
        for c in cands:
            if c and c[0] != "DEQ" and M <= 1024 and a.proj == "both" and c[0] > 64:
                continue
            if c and c[0] != "DEQ" and a.experts == "mx4" and a.proj != "both":
                continue                                            # mx4: whole tiles only
            cfg = dict(DEQ=c[1]) if c and c[0] == "DEQ" else config(c, a.proj, M)
            fn = lambda cfg=cfg: moe.fused_moe(x, idx, w, *st, 10.0, path="sorted",  # noqa: E731
                                               config=cfg)
            try:
                err = ((fn() - ref).norm() / ref.norm()).item()
                if M <= 64:
                    us = bk.graph_us([fn])
                    print(f"M={M} {c}: {us:8.1f} us  {byts / us / 1e6:6.0f} GB/s ({nexp} experts)"
                          f"  rel {err:.1e}", flush=True)
                    rows.append(dict(M=M, proj=a.proj, config=c, us=us, rel=err))
                else:
                    ms = bk.events_ms(fn, 5)
                    print(f"M={M} {a.proj} {c}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                          f"{byts / ms / 1e6:6.0f} GB/s  rel {err:.1e}", flush=True)
                    rows.append(dict(M=M, proj=a.proj, config=c, ms=ms, rel=err))
            except Exception as e:                                  # e.g. out of shared memory
                print(f"M={M} {c}: {type(e).__name__} {str(e)[:80]}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
