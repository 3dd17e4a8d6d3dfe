"""Quantized-linear and fused-MoE kernels at DeepSeek-V4-Flash shapes against the measured roofline.

    python benchmarks/kernels/bench_kernels.py [--out results.json] [--quick | --sweep |
    --moe-decode-sweep]

One process measures, in order: device copy bandwidth (read + write bytes of a 4 GiB copy), the
BF16 matmul peak (8192^3 torch.matmul) and the INT8 peak (8192^3 torch._int_mm), then
  linear  int8_g128 wq_a 4096->1024, wq_b 1024->32768, wo_b 8192->4096 (+ TP4 shards) at
          M = 1, 8, 64 (decode) and 1024, 8192 (prefill); bf16 weights; the torch path
          (dequantize + F.linear) beside it;
  moe     256 experts x (2048x4096 gate/up, 4096x2048 down) int8_mx32, top-6, random distinct
          experts per token, M = 1, 8, 64, 1024, 8192; the torch loop (kernels.ref) beside it.
Each kernel time is the median over CUDA-graph replays of several calls on rotating weight
copies (so small weights are not served from L2); floor = max(bytes / copy BW, FLOPs / peak),
bytes = weights actually read (distinct experts) + activations in and out. Correctness: every
case is compared with kernels.ref on the same inputs (relative Frobenius error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from backfit.quant import quantize_int8_groups  # noqa: E402
from backfit.runtime.kernels import moe, ref  # noqa: E402
from backfit.runtime.kernels.linear import gemm  # noqa: E402
from backfit.runtime.kernels.moe import mx4 as moe_mx4  # noqa: E402
from backfit.runtime.kernels.moe.common import DECODE_PAIRS, launch_decode  # noqa: E402
from harness import ceilings, events_ms, graph_us  # noqa: E402

DEV = "cuda"
E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)      # int8_mx32 codes by nibble


def mx_stack(E: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8_mx32 experts: codes [E, n, k] int8 and exponent bytes [E, n, k/32]."""
    vals = torch.tensor(E2M1_X2, dtype=torch.int8, device=DEV)
    return (vals[torch.randint(0, 16, (E, n, k), device=DEV)],
            torch.randint(118, 126, (E, n, k // 32), device=DEV, dtype=torch.uint8))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench_linear(name: str, N: int, K: int, Ms, ceil: dict, rows: list) -> None:
    wbytes = N * K + N * (K // 128) * 4
    copies = max(1, min(16, math.ceil(512e6 / wbytes)))
    ws = [quantize_int8_groups(torch.randn(N, K, device=DEV)) for _ in range(copies)]
    for M in Ms:
        x = torch.randn(M, K, device=DEV).bfloat16()
        q, s = ws[0]
        y = gemm.linear(x, q, s, "int8_g128")
        want = ref.linear_w8a8_ref(x, q, s) if M >= gemm.PREFILL_M \
            else ref.linear_ref(x, q, s, "int8_g128")
        err = rel(y, want)
        n_calls = copies if M < gemm.PREFILL_M else 2
        t = graph_us([lambda q=q, s=s: gemm.linear(x, q, s, "int8_g128") for q, s in ws[:n_calls]])
        t_torch = graph_us([lambda q=q, s=s: ref.linear_ref(x, q, s, "int8_g128")
                            for q, s in ws[:min(n_calls, 4)]])
        flops = 2 * M * N * K
        peak = ceil["int8_TOPs"] if M >= gemm.PREFILL_M else ceil["bf16_TFLOPs"]
        byts = wbytes + M * K * 2 + M * N * 2
        floor = max(byts / ceil["copy_TBps"] / 1e6, flops / peak / 1e6)     # µs
        rows.append(dict(kind="linear", name=name, N=N, K=K, M=M, us=t, torch_us=t_torch,
                         floor_us=floor, frac_roofline=floor / t,
                         frac_bw=byts / ceil["copy_TBps"] / 1e6 / t,
                         frac_peak=flops / peak / 1e6 / t,
                         path="w8a8" if M >= gemm.PREFILL_M else "a16", rel_err=err))
        print(f"linear {name:10s} M={M:5d} {t:9.1f} us  floor {floor:8.1f}  {floor / t:6.1%}  "
              f"torch {t_torch:9.1f} us  err {err:.1e}", flush=True)
    wb = torch.randn(N, K, device=DEV).bfloat16()
    for M in (1, 8192):
        x = torch.randn(M, K, device=DEV).bfloat16()
        err = rel(gemm.linear(x, wb, None, "bf16"), ref.linear_ref(x, wb, None, "bf16"))
        t = graph_us([lambda: gemm.linear(x, wb, None, "bf16")] * 2)
        t_cublas = graph_us([lambda: torch.nn.functional.linear(x, wb)] * 2)
        flops, byts = 2 * M * N * K, 2 * N * K + 2 * M * (K + N)
        floor = max(byts / ceil["copy_TBps"] / 1e6, flops / ceil["bf16_TFLOPs"] / 1e6)
        rows.append(dict(kind="linear_bf16", name=name, N=N, K=K, M=M, us=t, cublas_us=t_cublas,
                         floor_us=floor, frac_roofline=floor / t, rel_err=err))
        print(f"bf16   {name:10s} M={M:5d} {t:9.1f} us  floor {floor:8.1f}  {floor / t:6.1%}  "
              f"cuBLAS {t_cublas:9.1f} us  err {err:.1e}", flush=True)
    del ws


def bench_moe(Ms, ceil: dict, rows: list, E: int = 256, D: int = 4096, I: int = 2048,
              k: int = 6) -> None:
    st = (*mx_stack(E, I, D), *mx_stack(E, I, D), *mx_stack(E, D, I))
    per_expert = 3 * I * D * (1 + 1 / 32)
    for M in Ms:
        x = torch.randn(M, D, device=DEV).bfloat16()
        idx = torch.rand(M, E, device=DEV).argsort(1)[:, :k]          # k distinct experts a token
        w = torch.rand(M, k, device=DEV)
        y = moe.fused_moe(x, idx, w, *st, 10.0)
        err = rel(y, ref.moe_routed_ref(x, idx, w, *st, 10.0))
        n_exp = torch.unique(idx).numel()
        t = graph_us([lambda: moe.fused_moe(x, idx, w, *st, 10.0)] * 2)
        t_torch = events_ms(lambda: ref.moe_routed_ref(x, idx, w, *st, 10.0), reps=3) * 1e3
        flops = 2 * M * k * 3 * I * D
        byts = n_exp * per_expert + M * D * 2 * 2
        floor = max(byts / ceil["copy_TBps"] / 1e6, flops / ceil["bf16_TFLOPs"] / 1e6)
        rows.append(dict(kind="moe", M=M, experts_touched=n_exp, us=t, torch_us=t_torch,
                         floor_us=floor, frac_roofline=floor / t,
                         frac_bw=byts / ceil["copy_TBps"] / 1e6 / t,
                         frac_peak=flops / ceil["bf16_TFLOPs"] / 1e6 / t,
                         path="decode" if M * k <= DECODE_PAIRS else "sorted", rel_err=err))
        print(f"moe    M={M:5d} experts={n_exp:3d} {t:9.1f} us  floor {floor:8.1f}  "
              f"{floor / t:6.1%}  "
              f"torch {t_torch:9.1f} us  err {err:.1e}", flush=True)


def sweep(ceil: dict) -> list:
    """Tile configs of each launcher at key shapes (graph-timed µs); the defaults come from it."""
    res = []

    def best(tag, cands):
        times = {}
        for cfg, calls in cands:
            try:
                times[json.dumps(cfg)] = graph_us(calls)
            except Exception as e:                                   # e.g. out of shared memory
                times[json.dumps(cfg)] = float("inf")
                print(f"  {tag} {cfg}: {type(e).__name__}")
        order = sorted(times.items(), key=lambda kv: kv[1])
        print(f"sweep {tag}: " + "  ".join(f"{c} {t:.1f}" for c, t in order[:4]), flush=True)
        res.append(dict(tag=tag, times=times))
    for name, N, K in (("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
                       ("wq_b/tp4", 8192, 1024), ("wo_b/tp4", 4096, 2048)):
        ws = [quantize_int8_groups(torch.randn(N, K, device=DEV)) for _ in range(8)]
        for M in (1, 64):
            x = torch.randn(M, K, device=DEV).bfloat16()
            cands = []
            for cfg in (dict(BN=64), dict(BN=32), dict(BN=128), dict(BN=64, num_stages=3),
                        dict(BN=64, num_warps=8), dict(BN=32, num_stages=6)):
                for split in (None, 1):
                    c = dict(cfg, split_k=split)
                    cands.append((c, [lambda q=q, s=s, c=cfg, sp=split: gemm.linear(
                        x, q, s, "int8_g128", path="a16", split_k=sp, config=c) for q, s in ws]))
            best(f"a16 {name} M={M}", cands)
        if "/" not in name:
            x = torch.randn(8192, K, device=DEV).bfloat16()
            cands = []
            for bm, bn, st, wp in ((128, 128, 3, 8), (128, 128, 4, 8), (128, 256, 3, 8),
                                   (256, 128, 3, 8), (128, 128, 3, 4), (64, 128, 4, 4)):
                cfg = dict(BM=bm, BN=bn, num_stages=st, num_warps=wp)
                cands.append((cfg, [lambda q=q, s=s, c=cfg: gemm.linear(
                    x, q, s, "int8_g128", path="w8a8", config=c) for q, s in ws[:2]]))
            best(f"w8a8 {name} M=8192", cands)
        del ws
    E, D, I, k = 256, 4096, 2048, 6
    st = (*mx_stack(E, I, D), *mx_stack(E, I, D), *mx_stack(E, D, I))
    for M in (1, 8, 64, 1024, 8192):
        x = torch.randn(M, D, device=DEV).bfloat16()
        idx = torch.rand(M, E, device=DEV).argsort(1)[:, :k]
        w = torch.rand(M, k, device=DEV)
        if M * k <= DECODE_PAIRS:
            cfgs = [dict(BN=bn, BK=bk, num_warps=wp, num_stages=ns) for bn, bk, wp, ns in
                    ((32, 512, 4, 2), (32, 128, 4, 2), (16, 512, 4, 2), (64, 256, 4, 2),
                     (32, 512, 8, 2), (16, 256, 4, 3), (32, 256, 4, 3), (64, 512, 8, 2))]
            path = "decode"
        elif M <= 64:
            cfgs = [dict(BM=bm, BN=bn, BK=bk, num_warps=wp, num_stages=ns) for bm, bn, bk, wp, ns in
                    ((16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3),
                     (16, 32, 128, 4, 3), (16, 64, 128, 4, 2), (16, 64, 128, 4, 3))]
            path = "sorted"
        else:
            cfgs = [dict(BM=bm, BN=bn, BK=bk, num_warps=wp, num_stages=ns) for bm, bn, bk, wp, ns in
                    ((64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3),
                     (64, 64, 64, 4, 3), (128, 128, 32, 8, 4), (64, 128, 128, 8, 2),
                     (32, 128, 64, 4, 3))]
            path = "sorted"
        best(f"moe {path} M={M}",
             [(c, [lambda c=c, p=path: moe.fused_moe(x, idx, w, *st, 10.0, path=p, config=c)])
              for c in cfgs])
    return res


# --moe-decode-sweep grid: (BN, BK, warps, stages) per variant, most promising first, <= 128
# weights per thread for the [BN, BK/32] partial-sum variants, <= 32 for fma (its FP32
# accumulator has one register per weight of the tile), the shipped base tile first.
_TILES = dict(
    base=((16, 512, 4, 2), (32, 512, 4, 2), (16, 256, 4, 3)),
    magic=((16, 512, 4, 2), (8, 512, 4, 2), (32, 256, 4, 2), (32, 512, 8, 2), (64, 256, 8, 2),
           (16, 1024, 8, 2), (16, 256, 4, 3), (32, 512, 4, 2)),
    fma=((8, 512, 4, 2), (16, 256, 4, 2), (16, 512, 8, 2), (32, 256, 8, 2), (8, 256, 4, 2)),
    prefetch=((8, 512, 4, 2), (16, 256, 4, 2), (16, 512, 8, 2), (32, 256, 8, 2), (8, 1024, 8, 2),
              (16, 512, 4, 2)),
    group=((16, 512, 4, 2), (8, 512, 4, 2), (32, 512, 8, 2), (16, 1024, 8, 2)))
_MX4_TILES = dict(                                 # BK counts inputs (BK/2 bytes a row)
    # base / prefetch: the shipped tile and the 2026-12-01 sweep's best gate/up and down tiles
    base=((16, 1024, 4, 2), (8, 1024, 4, 2), (16, 512, 4, 3)),
    prefetch=((8, 1024, 4, 2),),
    # issue 10's packed decode: mma (tensor cores; BK 512 = 16 groups = the 16 MMA rows, BK
    # 1024 = 32 rows for 2 x 2 warps; warps split N, so BN = 16 x warps does not repeat the MMA;
    # every tile fits sm_80's 99 KB) and word (CUDA cores, int32 words). H200, commit 213e741:
    # mma BN 32 BK 512 w2 s2 57.4 us at M = 1 (int8 60.4 in the same run), word BN 16 BK 1024
    # w4 s2 63.5 (gate/up 38.0 alone, the best), base 79.4
    mma=((32, 512, 2, 2), (32, 512, 2, 3), (32, 256, 2, 3), (64, 512, 4, 2), (64, 256, 4, 3),
         (32, 1024, 4, 2), (16, 256, 1, 3), (16, 512, 1, 3)),
    word=((16, 1024, 4, 2), (16, 1024, 8, 2), (16, 2048, 8, 2), (16, 512, 4, 2)),
    # word4d: the TP-4 batch-1 gate/up tile (H100, 2026-12-06) and a wider one
    word4d=((1, 2048, 1, 2), (4, 1024, 2, 2)))


# --pipe: the K loop as a cp.async pipeline (config STAGES, kernels/moe_decode.py) over tiles
# with more, shorter K steps; (variant, BN, BK, warps, num_stages, STAGES). The shipped
# DECODE_TABLE configs run first in the same process (the baseline of the comparison). H200,
# 2026-12-01: no int8 tile beat the shipped one (59.4 vs 62.3 us at M = 1); mx4's mma at
# STAGES 3 did (63.7 -> 54.9 us) and is shipped.
_PIPE_TILES = {
    "int8_mx32": (("magic", 16, 256, 4, 3, 3), ("magic", 16, 256, 4, 4, 4),
                  ("magic", 16, 128, 4, 4, 4), ("magic", 8, 256, 4, 4, 4),
                  ("magic", 32, 128, 4, 4, 4), ("magic", 16, 512, 4, 3, 3),
                  ("magic", 8, 512, 4, 3, 3), ("base", 16, 256, 4, 4, 4),
                  ("base", 16, 512, 4, 3, 3), ("base", 32, 256, 4, 3, 3),
                  ("fma", 8, 256, 4, 4, 4), ("magic", 32, 256, 8, 3, 3)),
    "mx4_e2m1": (("mma", 32, 512, 2, 3, 3), ("mma", 32, 256, 2, 4, 4), ("mma", 64, 256, 4, 3, 3),
                 ("mma", 32, 512, 4, 3, 3), ("mma", 16, 512, 1, 3, 3), ("word", 16, 1024, 4, 3, 3),
                 ("word", 16, 512, 4, 4, 4), ("base", 16, 512, 4, 4, 4),
                 ("base", 8, 1024, 4, 3, 3))}

# --occ (int8_mx32, M = 1-2): the shipped tiles, then tiles with fewer weights per program (BN·BK)
# so more programs fit an SM. At M = 1 gate/up runs 6 x 2048/BN programs of ~95 registers a
# thread (5 an SM at 4 warps, 660 on 132 SMs): BN 16 gives 768, 1.16 waves, and BN 8 the same
# in rows (its half-size program fits twice as often); smaller BK cuts the registers, not the rows
# --occ mx4_e2m1 (2026-12-02): at tp 1 the shipped mma tile (BN 32, 255 registers at 2 warps)
# gives gate/up 6 x 64 programs, ~3 an SM, and streams half of int8's bytes in about int8's time:
# the bytes in flight are bound by the grid, as int8's were before its BN 8 tile. Here tiles of
# the word / base variants with BN 2-8 (the TP-4 rank's winner, word BN 4 BK 512 on 1 warp, first)
# and mma on 1 warp; (variant, BN, BK, warps, num_stages, STAGES) as _SMALL_I_TILES
_OCC_TILES = {
    "int8_mx32": tuple(t + (1,) for t in (
        ("magic", 16, 128, 4, 2), ("magic", 16, 128, 2, 2), ("magic", 8, 256, 2, 2),
        ("magic", 8, 128, 2, 2), ("magic", 32, 128, 4, 2), ("magic", 16, 64, 2, 2),
        ("magic", 8, 128, 1, 2), ("base", 16, 128, 4, 2), ("base", 16, 256, 2, 2),
        ("base", 8, 256, 2, 2), ("fma", 8, 128, 2, 2), ("fma", 16, 128, 4, 2))),
    "mx4_e2m1": (("word", 4, 512, 1, 2, 1), ("word", 4, 1024, 2, 2, 1), ("word", 8, 512, 2, 2, 1),
                 ("word", 8, 1024, 4, 2, 1), ("word", 2, 1024, 1, 2, 1), ("word", 8, 256, 1, 2, 1),
                 ("word", 4, 2048, 4, 2, 1), ("word", 4, 512, 1, 3, 3), ("base", 4, 1024, 2, 2, 1),
                 ("base", 8, 512, 2, 2, 1), ("mma", 16, 512, 1, 3, 3), ("mma", 16, 256, 1, 3, 3),
                 ("mma", 32, 256, 2, 3, 3))}

ERR_OK = 1e-2                 # rel err vs the torch path above which a config is not a candidate


# One TP-K rank (--moe-tp K: I = 2048 / K output rows for gate/up): small BN, few warps (the
# 2026-12-02 probes at I = 512: int8 gate/up 23.8 -> 11.8 us, mx4 24.4 -> 15.3 at M = 1)
_SMALL_I_TILES = {
    "int8_mx32": (("magic", 2, 1024, 2, 2, 1), ("magic", 2, 512, 1, 2, 1), ("magic", 4, 512, 2, 2, 1),
                  ("magic", 1, 512, 1, 2, 1), ("magic", 4, 1024, 4, 2, 1), ("magic", 16, 256, 4, 2, 1),
                  ("base", 8, 512, 2, 2, 1), ("base", 32, 512, 8, 2, 1)),
    "mx4_e2m1": (("word", 4, 512, 1, 2, 1), ("word", 4, 1024, 2, 2, 1), ("base", 4, 1024, 2, 2, 1),
                 ("mma", 64, 512, 4, 3, 3), ("mma", 16, 512, 2, 3, 3), ("mma", 32, 512, 2, 1, 1),
                 # whole rows in one K step (gate/up K = 4096), then fewer rows a down program:
                 # none beat the shipped rows (H100, 2026-12-06; moe/mx4.py's DECODE_TABLE note)
                 ("word", 4, 4096, 4, 1, 1), ("word", 4, 4096, 8, 1, 1), ("word", 2, 4096, 4, 1, 1),
                 ("word", 8, 4096, 8, 1, 1), ("word", 4, 2048, 4, 1, 1), ("word", 2, 2048, 2, 1, 1),
                 ("base", 4, 4096, 8, 1, 1), ("word", 8, 512, 1, 1, 1), ("word", 16, 512, 2, 1, 1),
                 ("word", 32, 512, 4, 1, 1), ("mma", 32, 512, 4, 1, 1), ("mma", 16, 512, 1, 1, 1),
                 # more one-warp programs a pair (H100, 2026-12-06: 14.3 / 19.8 / 15.7 us against
                 # word BN 4's 14.5), then word4d (the shipped gate/up 10.65 us, BN 1 BK 2048)
                 ("word", 2, 512, 1, 2, 1), ("word", 1, 512, 1, 2, 1), ("word", 2, 256, 1, 2, 1),
                 ("word4d", 1, 2048, 1, 2, 1), ("word4d", 2, 1024, 2, 2, 1),
                 ("word4d", 4, 1024, 2, 2, 1), ("word4d", 1, 512, 1, 2, 1),
                 ("word4d", 8, 256, 1, 2, 1))}


def decode_grid(scheme: str, pipe: bool = False, occ: bool = False,
                small_i: bool = False) -> list[dict]:
    """int8_mx32: 26 configs over moe.int8.DECODE_VARIANTS; mx4_e2m1: 18 over moe_mx4's (the
    shipped tile, then mma, word, word4d, prefetch, the rest of base: a spent budget skips the
    last).
    pipe: the shipped DECODE_TABLE configs (down tiles split out as configs of their own), then
    _PIPE_TILES. occ: the shipped configs, then _OCC_TILES[scheme]. small_i: the shipped
    configs, then _SMALL_I_TILES."""
    if pipe or occ or small_i:
        table = (moe_mx4 if scheme == "mx4_e2m1" else moe.int8).DECODE_TABLE
        shipped = []
        for row in table:                         # (max pairs, [max I,] config)
            c = dict(row[-1])
            for d in (c.pop("down", None), c):
                if d is not None and d not in shipped:
                    shipped.append(d)
        if occ:
            return shipped + [dict(variant=v, BN=b, BK=k, num_warps=w, num_stages=n, STAGES=st)
                              for v, b, k, w, n, st in _OCC_TILES[scheme]]
        if small_i:
            return shipped + [dict(variant=v, BN=b, BK=k, num_warps=w, num_stages=n, STAGES=st)
                              for v, b, k, w, n, st in _SMALL_I_TILES[scheme]]
        return shipped + [dict(variant=v, BN=b, BK=k, num_warps=w, num_stages=n, STAGES=st)
                          for v, b, k, w, n, st in _PIPE_TILES[scheme]]
    if scheme == "mx4_e2m1":
        assert set(_MX4_TILES) == set(moe_mx4.DECODE_VARIANTS), moe_mx4.DECODE_VARIANTS
        order = ("mma", "word", "word4d", "prefetch")
        tiles = [("base", _MX4_TILES["base"][0])] + [
            (v, t) for v in order for t in _MX4_TILES[v]] + [
            ("base", t) for t in _MX4_TILES["base"][1:]]
    else:
        assert set(_TILES) == set(moe.int8.DECODE_VARIANTS), moe.int8.DECODE_VARIANTS
        order = ("magic", "fma", "prefetch", "group")       # after the shipped tile, base last
        tiles = [("base", _TILES["base"][0])] + [(v, t) for v in order for t in _TILES[v]] + [
            ("base", t) for t in _TILES["base"][1:]]
    return [dict(variant=v, BN=b, BK=k, num_warps=w, num_stages=n) for v, (b, k, w, n) in tiles]


def mx4_stack(E: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random mx4_e2m1 experts: packed codes [E, n, k/2] uint8 and exponents [E, n, k/32]."""
    return (torch.randint(0, 256, (E, n, k // 2), device=DEV, dtype=torch.uint8),
            torch.randint(119, 127, (E, n, k // 32), device=DEV, dtype=torch.uint8))


def moe_ref_mx4(x, idx, w, w1, s1, w3, s3, w2, s2, limit: float) -> torch.Tensor:
    """kernels.ref.moe_routed_ref's math on dequant_mx4 weights (the torch path for mx4)."""
    from backfit.quant import dequant_mx4

    def lin(a, q, sc):                             # Linear.forward on dequantized weights
        return torch.nn.functional.linear(a, dequant_mx4(q, sc).to(a.dtype))
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        h = ref.swiglu_ref(lin(x[rows], w1[e], s1[e]), lin(x[rows], w3[e], s3[e]), limit)
        h = h * w[rows, slot][:, None]
        y.index_add_(0, rows, lin(h.to(x.dtype), w2[e], s2[e]).float())
    return y


def decode_launches(scheme: str, st: tuple, x, idx, w, cfg: dict) -> tuple:
    """fused_moe's two decode launches alone (gate/up -> h, down reading a fixed random h)."""
    kern = moe_mx4._GEMV4 if scheme == "mx4_e2m1" else moe.int8._GEMV
    w1, s1, w3, s3, w2, s2 = st
    (P, k), I, D, K = (idx.numel(), idx.shape[1]), w1.shape[1], w2.shape[1], x.shape[1]
    ids, rw = idx.reshape(-1).int(), w.reshape(-1).float()
    h, h_in = torch.empty(P, I, device=DEV).bfloat16(), torch.randn(P, I, device=DEV).bfloat16()
    out = torch.empty(P, D, dtype=torch.bfloat16, device=DEV)
    return (lambda: launch_decode(kern, P, I, K, cfg, (x, ids, rw, w1, s1, w3, s3, h, I, K, k),
                                       GATED=True, LIMIT=10.0),
            lambda: launch_decode(kern, P, D, I, cfg, (h_in, ids, rw, w2, s2, w2, s2, out, D,
                                                            I, k), GATED=False, LIMIT=10.0))


def moe_decode_sweep(ceil: dict, budget_s: float, t0: float, Ms=(1, 2, 4, 8), E: int = 256,
                     D: int = 4096, I: int = 2048, k: int = 6, rot: int = 4,
                     pipe: bool = False, occ: bool = False, tp: int = 1,
                     schemes=("int8_mx32", "mx4_e2m1")) -> dict:
    """Every decode variant x tile at M tokens, both schemes: graph-timed µs per call over `rot`
    routings (other experts each call: weights stream from HBM), GB/s of the distinct experts'
    bytes, % of the copy bandwidth, rel err vs the torch path; best per (scheme, M)."""
    rows, best = [], {}
    I //= tp                                       # one TP-tp rank's share of each expert
    for scheme in schemes:
        st = sum(((mx4_stack if scheme == "mx4_e2m1" else mx_stack)(E, n, kk)
                  for n, kk in ((I, D), (I, D), (D, I))), ())          # w1, s1, w3, s3, w2, s2
        per_expert = 3 * I * D * ((0.5 if scheme == "mx4_e2m1" else 1) + 1 / 32)
        refn = moe_ref_mx4 if scheme == "mx4_e2m1" else ref.moe_routed_ref
        cases = {}
        for M in Ms:
            xs = [torch.randn(M, D, device=DEV).bfloat16() for _ in range(rot)]
            idxs = [torch.rand(M, E, device=DEV).argsort(1)[:, :k] for _ in range(rot)]
            ws = [torch.rand(M, k, device=DEV) for _ in range(rot)]
            n_exp = sum(torch.unique(i).numel() for i in idxs) / rot
            byts = n_exp * per_expert + M * D * 2 * 2 + M * k * I * 4      # x, y, h (w, r)
            cases[M] = (xs, idxs, ws, byts, refn(xs[0], idxs[0], ws[0], *st, 10.0))
        stop = t0 + budget_s * (0.62 if scheme == "int8_mx32" and len(schemes) > 1 else 1.0)
        for cfg in decode_grid(scheme, pipe, occ, small_i=tp > 1):
            if time.time() > stop:
                print(f"  budget {budget_s:.0f} s spent: {scheme} {cfg} skipped", flush=True)
                continue
            for M, (xs, idxs, ws, byts, want) in cases.items():
                try:
                    err = rel(moe.fused_moe(xs[0], idxs[0], ws[0], *st, 10.0, path="decode",
                                            config=cfg), want)
                    t = graph_us([lambda a=a, i=i, w=w: moe.fused_moe(
                        a, i, w, *st, 10.0, path="decode", config=cfg)
                        for a, i, w in zip(xs, idxs, ws)])
                    one = [decode_launches(scheme, st, *c, cfg) for c in zip(xs, idxs, ws)]
                    t_up, t_dn = graph_us([u for u, _ in one]), graph_us([d for _, d in one])
                except Exception as e:                                 # e.g. out of resources
                    print(f"  {scheme} {cfg} M={M}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                gbs = byts / t / 1e3
                rows.append(dict(scheme=scheme, config=cfg, M=M, us=t, GBps=gbs, up_us=t_up,
                                 down_us=t_dn, frac_copy=gbs / 1e3 / ceil["copy_TBps"],
                                 rel_err=err))
                tile = "BN{BN:<3d} BK{BK:<5d} w{num_warps} s{num_stages}".format(**cfg) + (
                    f" S{cfg['STAGES']}" if "STAGES" in cfg else "")
                print(f"{scheme:9s} {cfg['variant']:8s} {tile} M={M} {t:8.1f} us "
                      f"{gbs:6.0f} GB/s {rows[-1]['frac_copy']:6.1%}  err {err:.1e}  "
                      f"(gate/up {t_up:.1f} + down {t_dn:.1f} us alone)", flush=True)
                for key, tt in (((scheme, M), t), ((scheme, M, "up"), t_up),
                                ((scheme, M, "down"), t_dn)):
                    if err < ERR_OK and tt < best.get(key, (None, math.inf))[1]:
                        best[key] = (cfg, tt)
        del st, cases
    print("\n# best per (scheme, M): DECODE_TABLE for kernels/moe/int8.py / moe/mx4.py;"
          " the split one (a down tile of its own) where its sum beats the fused time")
    for scheme, split in [(sc, sp) for sc in ("int8_mx32", "mx4_e2m1") for sp in (False, True)
                          if (sc, Ms[0]) in best]:
        tab = []                                   # (max pairs, config), equal neighbours merged
        for M in (M for M in Ms if (scheme, M) in best):
            cfg = best[(scheme, M)][0]
            if split:                              # own best tiles for gate/up and for down
                cfg = dict(best[(scheme, M, "up")][0], down=best[(scheme, M, "down")][0])
            if tab and tab[-1][1] == cfg:
                tab.pop()
            tab.append((str(M * k), cfg))
        print(f"# {scheme} " + ("split (gate/up + down alone, sum): " if split else "fused: ")
              + ", ".join(f"M={M} {best[(scheme, M)][1]:.1f} us" if not split else
                          f"M={M} {best[(scheme, M, 'up')][1] + best[(scheme, M, 'down')][1]:.1f}"
                          " us" for M in Ms if (scheme, M) in best))
        if tab:
            tab[-1] = ("DECODE_PAIRS", tab[-1][1])
        bound = f"{I}, " if tp > 1 else ""        # tp > 1: rows bounded by this rank's I
        print("DECODE_TABLE rows = (" + ",\n                ".join(
            f"({n}, {bound}dict({', '.join(f'{a}={b!r}' for a, b in c.items())}))"
            for n, c in tab) + ",)" if tab else f"# (no config within rel err {ERR_OK})")
    return dict(rows=rows, best=[dict(key=list(key), config=c, us=t)
                                 for key, (c, t) in best.items()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--quick", action="store_true", help="decode shapes only")
    ap.add_argument("--sweep", action="store_true", help="time tile configs instead")
    ap.add_argument("--moe-decode-sweep", action="store_true",
                    help="MoE decode GEMV variants x tiles, M = 1-8, int8_mx32 and mx4_e2m1")
    ap.add_argument("--pipe", action="store_true",
                    help="--moe-decode-sweep over the shipped tiles + the cp.async-pipelined ones")
    ap.add_argument("--occ", action="store_true",
                    help="--moe-decode-sweep at M = 1, 2: the shipped tiles + tiles of fewer "
                         "weights a program (_OCC_TILES)")
    ap.add_argument("--schemes", default="int8_mx32,mx4_e2m1",
                    help="--moe-decode-sweep: the expert schemes to sweep (comma-separated)")
    ap.add_argument("--moe-tp", type=int, default=1, metavar="K",
                    help="--moe-decode-sweep at one TP-K rank's experts (I = 2048 / K), over the "
                         "shipped tiles + _SMALL_I_TILES")
    ap.add_argument("--budget-s", type=float, default=115.0,
                    help="--moe-decode-sweep: skip the configs left after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    ceil = ceilings()
    print(f"device {torch.cuda.get_device_name()}  copy {ceil['copy_TBps']:.2f} TB/s  "
          f"bf16 {ceil['bf16_TFLOPs']:.0f} TFLOP/s  int8 {ceil['int8_TOPs']:.0f} TOP/s", flush=True)
    if args.moe_decode_sweep:
        res = dict(device=torch.cuda.get_device_name(), triton=__import__("triton").__version__,
                   ceilings=ceil, **moe_decode_sweep(ceil, args.budget_s, t0, pipe=args.pipe,
                                                    occ=args.occ, tp=args.moe_tp,
                                                    Ms=(1, 2) if args.occ else (1, 2, 4, 8),
                                                    schemes=tuple(args.schemes.split(","))))
        Path(args.out).write_text(json.dumps(dict(res, seconds=time.time() - t0), indent=1))
        print(f"done in {time.time() - t0:.0f} s -> {args.out}")
        return
    if args.sweep:
        Path(args.out).write_text(json.dumps(dict(ceilings=ceil, sweep=sweep(ceil)), indent=1))
        return
    Ms = (1, 8, 64) if args.quick else (1, 8, 64, 1024, 8192)
    rows: list = []
    for name, N, K in (("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
                       ("wq_b/tp4", 8192, 1024), ("wo_b/tp4", 4096, 2048)):
        bench_linear(name, N, K, Ms if "/" not in name else (1, 8, 64), ceil, rows)
    bench_moe(Ms, ceil, rows)
    commit = os.environ.get("BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = "?"
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, commit=commit, ceilings=ceil, rows=rows,
               seconds=time.time() - t0)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"done in {res['seconds']:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
