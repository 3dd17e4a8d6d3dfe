"""Time the indexer's top-k (kernels.attention.indexer.topk_select, top-512) on one GPU: the old
path
(TOPK_FAST = False: _topk_scores / _topk_keys / _unpack kernels + a fill) against the fast path
(_topk_pass_kernel: TOPK_MERGE reduction passes at TOPK_WARPS 4 and 8, bitonic reduction
passes at 4 warps, and 1024-wide scores chunks, TOPK_SCORES_CHUNK, at 8 warps), as CUDA-graph
replays (launch gaps excluded, as in the decode graph).

Rows: B in {1, 8, 64}, N (table width x block) in {4096, 16384, 65536}, n_valid in {128, 512,
2048, 8192, N} (<= N): random scores, -inf from n_valid on in every row (the decode / prefill
prefix). Each time (µs, median of 20 replays) is also shown as a fraction of the copy roofline
(the B·N·4 score bytes read once, at the copy bandwidth measured in the same run; these kernels
are latency-bound, so it stays small). `bad`: rows of sel that differ from torch
(kernels.ref.topk_select_ref, a stable torch.sort) - must be 0 for every variant.
--rank: the scores pass's ranking of a live prefix (TOPK_RB x TOPK_RB_BJ blocks, RANK) at B 1
and 8, N 256 / 1024 / 16384, n_valid 64-512 (the decode step's rows: n_valid = (p+1)//4).
Usage: python benchmarks/kernels/bench_topk.py [--out bench_topk.json] [--quick | --rank]
(the variants' reduction chunk is topk_select's `chunk`, TOPK_CHUNK by default)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backfit.runtime.kernels import ref
from backfit.runtime.kernels.attention import indexer
from harness import copy_bandwidth, graph_time  # noqa: E402

K = 512
# (name, TOPK_FAST, TOPK_MERGE, TOPK_WARPS, TOPK_SCORES_CHUNK, chunk of the reduction passes)
VARIANTS = [("old", False, False, 4, 0, 2048), ("fast w4", True, True, 4, 0, 2048),
            ("fast w8", True, True, 8, 0, 2048), ("fast bitonic w4", True, False, 4, 0, 2048),
            ("fast w8 Cs1024", True, True, 8, 1024, 2048),
            ("fast w8 Cs1024 C1024", True, True, 8, 1024, 1024),
            ("fast w16 Cs1024", True, True, 16, 1024, 2048),
            ("fast w4 Cs1024", True, True, 4, 1024, 2048)]
QUICK = ("fast w4", "fast w8", "fast w8 Cs1024", "fast w8 Cs1024 C1024", "fast w16 Cs1024",
         "fast w4 Cs1024")          # --quick: the fast-path candidates only


# --rank: the scores pass's ranking of a live prefix (TOPK_RB, TOPK_RB_BJ; RB 0: [K, TOPK_BJ])
RANK = [("K x 16", 0, 16), ("RB 64 x 64", 64, 64), ("RB 128 x 32", 128, 32),
        ("RB 128 x 64", 128, 64), ("RB 128 x 128", 128, 128), ("RB 256 x 64", 256, 64),
        ("RB 512 x 64", 512, 64)]


def rows_for(quick: bool, rank: bool = False):
    if rank:                    # the decode step's top-k: B 1 and 8, prefixes, short tables too
        for B in (1, 8):
            for N in (256, 1024, 16384):
                for n_valid in sorted({min(v, N) for v in (64, 128, 256, 512)}):
                    yield B, N, n_valid
        return
    for B in (1, 8) if quick else (1, 8, 64):
        for N in (4096, 8192, 16384) if quick else (4096, 16384, 65536):
            for n_valid in sorted({v for v in (128, 512, 2048, 8192, N) if v <= N}):
                yield B, N, n_valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_topk.json")
    ap.add_argument("--quick", action="store_true",
                    help="B 1, 8, N 4096, 8192, 16384, the fast-path candidates (QUICK) only")
    ap.add_argument("--rank", action="store_true",
                    help="the live-prefix ranking variants (RANK) at decode-like rows instead")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if not args.quick or v[0] in QUICK]
    if args.rank:               # as shipped but for the ranking
        variants = [(name, True, True, indexer.TOPK_WARPS, indexer.TOPK_SCORES_CHUNK,
                     indexer.TOPK_CHUNK, rb, bj) for name, rb, bj in RANK]
    else:
        variants = [v + (indexer.TOPK_RB, indexer.TOPK_RB_BJ) for v in variants]
    t0 = time.time()
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out, saved = [], (indexer.TOPK_WARPS, indexer.TOPK_MERGE, indexer.TOPK_SCORES_CHUNK,
                      indexer.TOPK_RB, indexer.TOPK_RB_BJ)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; top-{K}; µs per call (roofline fraction)")
    print(f"{'B':>3} {'N':>6} {'n_valid':>7} " + " ".join(f"{v[0]:>18}" for v in variants)
          + "  bad")
    for B, N, n_valid in rows_for(args.quick, args.rank):
        s = torch.randn(B, N, device="cuda", generator=gen)
        s[:, n_valid:] = float("-inf")
        want = ref.topk_select_ref(s, K)
        row, cells, bad = dict(B=B, N=N, n_valid=n_valid), [], 0
        for name, fast, merge, warps, cs, chunk, rb, bj in variants:
            (indexer.TOPK_WARPS, indexer.TOPK_MERGE, indexer.TOPK_SCORES_CHUNK, indexer.TOPK_RB,
             indexer.TOPK_RB_BJ) = warps, merge, cs, rb, bj
            try:
                sel = indexer.topk_select(s, K, chunk, fast=fast)
                us = graph_time(lambda s=s, f=fast, c=chunk: indexer.topk_select(s, K, c, fast=f),
                                reps=20) * 1e6
            except Exception as e:                  # a config that does not compile / fit
                row[name] = dict(error=f"{type(e).__name__}: {e}"[:200])
                cells.append("failed")
                continue
            n_bad = int((sel != want).any(dim=1).sum())
            bad += n_bad
            frac = B * N * 4 / bw / (us * 1e-6)
            row[name] = dict(us=us, roofline=frac, bad_rows=n_bad)
            cells.append(f"{us:9.1f} ({frac:5.3f})")
        (indexer.TOPK_WARPS, indexer.TOPK_MERGE, indexer.TOPK_SCORES_CHUNK, indexer.TOPK_RB,
         indexer.TOPK_RB_BJ) = saved
        out.append(row)
        print(f"{B:>3} {N:>6} {n_valid:>7} " + " ".join(f"{c:>18}" for c in cells)
              + f"  {bad}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, k=K, rows=out), f,
                  indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
