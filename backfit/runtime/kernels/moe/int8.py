"""Fused MoE for stacked int8_mx32 experts (docs/FORMAT.md), in Triton, SM80-safe (the math and
the launch sequence: kernels.moe.common).

Experts of a layer as stacked tensors: w1/w3 (gate/up) [E, I, K] int8 with exponent bytes
[E, I, K/32], w2 (down) [E, D, I] int8 with [E, D, I/32]; value = q · 2^(e - 128). Weights are
dequantized in registers to BF16, exactly (|q| <= 12 needs 4 mantissa bits), and multiplied with
BF16 activations on the BF16 tensor cores with FP32 accumulation; no INT8 activations. The
sorted tensor-core kernel is here; the decode GEMVs are in kernels.moe.int8_decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.formats import MX_GROUP
from backfit.runtime.kernels.common import dot_bf16
from backfit.runtime.kernels.moe import common
from backfit.runtime.kernels.moe.common import DECODE_PAIRS, _swiglu, run_moe
from backfit.runtime.kernels.moe.int8_decode import SUM_ROWS, _dequant_bf16, _dequant_mx, \
    _moe_gemv_group_kernel, _moe_gemv_kernel

__all__ = ["DECODE_TABLE", "DECODE_VARIANTS", "DOWN_SUM", "decode_config", "fused_moe_int8"]

MX_BIAS = 128            # int8_mx32 exponent bias (2·e2m1 absorbs one factor 2)


@triton.jit
def _sorted_tile(q, S, s_off, k0, rg, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                 DEQ: tl.constexpr, F32: tl.constexpr):
    """int8 codes q [BN, BK] at K offset k0 -> BF16 q·2^(e-128) (exact), exponents [BN, BK/32]
    from S (DEQ: see _moe_sorted_kernel; F32: the interpreter, which has no inline PTX)."""
    s = tl.load(S + s_off + k0 // 32 + rg[None, :], mask=n_ok[:, None], other=0)
    if DEQ == 0:
        return _dequant_mx(q, s, BN, BK).to(tl.bfloat16)
    return _dequant_bf16(q, s, BN, BK, F32)


@triton.jit
def _moe_sorted_kernel(A, SORTED, BLOCK_E, RW, W1, S1, W3, S3, OUT, N, K, TOPK, P, E,
                       GATED: tl.constexpr, LIMIT: tl.constexpr, F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       DEQ: tl.constexpr = 0):
    """Block b (BM slots of one expert) x rows [pid_n·BN, +BN). GATED: x rows by pair // k ->
    h [slots, N] at the slot; else h rows by slot -> out [P, N] at the pair. DEQ (the same BF16
    weights, bit for bit): 0, codes to FP32 (I2F), times the group's 2^(e-128), to BF16 (F2F);
    2 (the default, SORTED_DEQ), no int -> float conversion: _dequant_bf16's BF16 bit trick, 4
    codes a step in PTX. (A DEQ 1, exponents loaded per weight, lost on 2026-12-02 and went in
    2026-12-04.)"""
    b, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_E + b)
    if e >= E:
        return                                               # past the real block count
    e = e.to(tl.int64)
    slots = b * BM + tl.arange(0, BM)
    pair = tl.load(SORTED + slots)
    valid = pair < P                                         # padding slots hold P
    arow = pair // TOPK if GATED else slots
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rg = tl.arange(0, BK // 32)
    n_ok = rn < N
    KG = K // 32
    w_off = e * N * K + rn[:, None] * K
    s_off = e * N * KG + rn[:, None] * KG
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + arow[:, None].to(tl.int64) * K + k0 + rk[None, :], mask=valid[:, None],
                    other=0.0)
        q = tl.load(W1 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
        acc1 = dot_bf16(a, tl.trans(_sorted_tile(q, S1, s_off, k0, rg, n_ok, BN, BK, DEQ, F32)),
                        acc1, F32)
        if GATED:
            q = tl.load(W3 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
            acc3 = dot_bf16(a, tl.trans(_sorted_tile(q, S3, s_off, k0, rg, n_ok, BN, BK, DEQ,
                                                     F32)), acc3, F32)
    mask = valid[:, None] & n_ok[None, :]
    if GATED:
        wr = tl.load(RW + pair, mask=valid, other=0.0)
        h = _swiglu(acc1, acc3, wr[:, None], LIMIT)
        tl.store(OUT + slots[:, None].to(tl.int64) * N + rn[None, :], h.to(tl.bfloat16), mask=mask)
    else:
        tl.store(OUT + pair[:, None].to(tl.int64) * N + rn[None, :], acc1.to(tl.bfloat16),
                 mask=mask)


# tile configs: best of an H200 sweep at V4-Flash shapes (benchmarks/kernels/bench_kernels.py
# --sweep).
# Decode: (max pairs P, config) rows, the first with P <= max pairs applies (a "down" dict in a
# config: the down projection's own tile/variant); the lead pastes the table printed by
# `bench_kernels.py --moe-decode-sweep` here (variants: DECODE_VARIANTS, see above).
# best per pair count of `bench_kernels.py --moe-decode-sweep` on the H200 (2026-12-01, commit
# 16bc670; docs/KERNELS.md): M=1 60.6 us (was 83.6 with base BN16 BK512 for both projections).
# 2026-12-02 (H200, .whl probes, graph-timed over 4 routings): gate/up magic BN 8 BK 256 on 2
# warps 36.2 us at M = 1 (BN 16 BK 256 4 warps: 37.5), 213.9 at M = 8 (BN 8 BK 512 4 warps: 219.0);
# the step (bench_ab.py, replay GPU time, same process): -10.0 us at batch 1, -28.8 at batch 8.
# Rows with a third field bound I, the experts' intermediate size on this rank: at TP 4 (I = 512)
# the tp-1 tile gives gate/up only 192-384 programs of 16 K steps (23.8 us at M = 1 for 6.2 us of
# bytes); BN 2 BK 1024 on 2 warps 11.8 us, BN 2 BK 512 on 1 warp 57.5 at M = 8 (66.7); the down
# tile stays (8.5 / 35.2 us; the best of 8 others within 0.4 / 1.3). TP 8 (I = 256) takes the
# TP-4 rows, not measured.
_DOWN = dict(variant="base", BN=16, BK=512, num_warps=4, num_stages=2)
DECODE_TABLE = ((6, 512, dict(variant="magic", BN=2, BK=1024, num_warps=2, num_stages=2,
                              down=_DOWN)),
                (DECODE_PAIRS, 512, dict(variant="magic", BN=2, BK=512, num_warps=1,
                                         num_stages=2, down=_DOWN)),
                (DECODE_PAIRS, dict(variant="magic", BN=8, BK=256, num_warps=2, num_stages=2,
                                    down=_DOWN)))
DECODE_VARIANTS = ("base", "group", "magic", "fma", "prefetch")
# The down launch summing each token's pairs (common.launch_down_sum: no combine launch): None
# = off, else a tile of int8_decode.SUM_ROWS' variants and "max_pairs" (as moe.mx4.DOWN_SUM).
# Off: H200, 43-layer TP-4 slice, bench_ab.py (2026-12-07, GPU time of the replay, against the
# base down + combine at batch 1): base BN 2 BK 512 on 1 warp -0.9 us, BN 4 +185.7, BN 8 on 2
# warps +56.3.
DOWN_SUM: dict | None = None


def decode_config(K: int, P: int = 1, down: bool = False, I: int | None = None) -> dict:
    """common.decode_config on this scheme's DECODE_TABLE."""
    return common.decode_config(K, P, DECODE_TABLE, down, I)


_GEMV = dict(base=(_moe_gemv_kernel, {}),
             group=(_moe_gemv_group_kernel, dict(MODE=0, PREFETCH=False)),
             magic=(_moe_gemv_group_kernel, dict(MODE=1, PREFETCH=False)),
             fma=(_moe_gemv_group_kernel, dict(MODE=2, PREFETCH=False)),
             prefetch=(_moe_gemv_group_kernel, dict(MODE=1, PREFETCH=True)))


def fused_moe_int8(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
              s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
              s2: torch.Tensor, limit: float, path: str | None = None,
              config: dict | None = None, shared: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32,
              shared_ready: torch.cuda.Event | None = None, pairs: bool = False):
    """x [T, K] bf16, idx [T, k], w [T, k] -> routed-expert sum [T, D] (+ shared [T, D], the
    shared expert's output) in `dtype` (FP32 sum either way: pointwise.moe_combine); path
    "decode"/"sorted" and config (tile overrides) replace the automatic choice (tests,
    benchmarks). shared_ready: an event after which `shared` is written (it was computed on a
    side stream): the current stream waits for it only before the combine, so the routed
    launches overlap it.
    pairs: return the combine's inputs unsummed (pointwise.PairSum, for mhc_decode.hc_post)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"fused_moe: x must be bf16 [T, K], got {x.dtype}{list(x.shape)}")
    E, I, K = w1.shape
    D = w2.shape[1]
    for name, t, shape, dt in (("w1", w1, (E, I, K), torch.int8), ("w3", w3, (E, I, K), torch.int8),
                               ("s1", s1, (E, I, K // MX_GROUP), torch.uint8),
                               ("s3", s3, (E, I, K // MX_GROUP), torch.uint8),
                               ("w2", w2, (E, D, I), torch.int8),
                               ("s2", s2, (E, D, I // MX_GROUP), torch.uint8)):
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"fused_moe: {name} must be contiguous {dt}{list(shape)}, "
                             f"got {t.dtype}{list(t.shape)}")
    return run_moe(x, idx, w, (w1, s1, w3, s3, w2, s2), (E, I, K, D), limit, path, config,
                   _GEMV, DECODE_TABLE, _moe_sorted_kernel, ({}, {}), shared, dtype,
                   shared_ready, pairs=pairs, down_sum=(SUM_ROWS, DOWN_SUM))


