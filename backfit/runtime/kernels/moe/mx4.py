"""Fused MoE for stacked mx4_e2m1 experts (docs/FORMAT.md), in Triton, SM80-safe.

The same two launches, paths, roundings and launcher API as kernels.moe.int8 (int8_mx32; its
docstring
states the math), for 4-bit experts: w1/w3 [E, I, K/2] uint8 packed e2m1 codes (low nibble =
element 2j, high nibble = 2j+1, as quant.unpack_e2m1 / dequant_mx4) with UE8M0 exponent bytes
[E, I, K/32], w2 [E, D, I/2] with [E, D, I/32]; value = e2m1 · 2^(e - 127).

Decoding in registers, no table in memory and no FP4 instruction (SM80 has none):
  e2m1   nibble n: FP32 bits (n·(2^22 + 2^28)) & 0x81C00000 (one multiply, one mask) are
         e2m1(n)·2^-126 exactly (E = 0 codes as FP32 subnormals): the 16-entry LUT as arithmetic.
  scale  FP32 bits e << 23 = 2^(e-127) for e >= 1, 1 << 22 = 2^-127 for e = 0 (subnormal).
Every weight e2m1 · 2^(e-127) is exact in BF16 (one mantissa bit) for e <= 252.
A K tile of BK inputs is BK/2 bytes: the activations are split into even / odd columns
(reshape + split of one contiguous load), so no nibble interleave is needed:
  decode  (x_even·2^63)·lo + (x_odd·2^63)·hi per byte in FP32, summed per 32-group, times 2^63
          and 2^(e-127) per group: powers of two only, so the same FP32 result as scaling each
          weight first (for |x| < 2^65 and |w·x| >= 2^-63).
  sorted  DEQ 2 (the default): each byte to one BF16 pair in input order in PTX (_PAIR_ASM:
          the nibbles' bits placed as BF16 e2m1·2^-126, then BF16 FMAs by 2^126 and 2^(e-127)),
          one BF16 tl.dot a K tile; DEQ 0: lo and hi values as above to two FP32 -> BF16 tiles
          [BN, BK/2], two dots with the even / odd activations.
Decode variants (config "variant", DECODE_TABLE): base, prefetch, word, word4d and mma, in
kernels.moe.mx4_decode with the nibble decoding both paths share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backfit.formats import MX_GROUP
from backfit.runtime.kernels.common import dot_bf16, interpreted
from backfit.runtime.kernels.moe import common
from backfit.runtime.kernels.moe.common import DECODE_PAIRS, _swiglu, align, fit_bk, \
    launch_decode, run_moe, sorted_config
from backfit.runtime.kernels.moe.mx4_decode import GEMV_KERNELS, SUM_ROWS, _TWO126, \
    _e2m1_hi, _e2m1_lo, _pow2

__all__ = ["DECODE_TABLE", "DECODE_VARIANTS", "DOWN_SUM", "fused_moe_mx4", "mx4_linear_pairs"]


@triton.jit
def _dequant_half(v, s, BN: tl.constexpr, BK: tl.constexpr):
    """One nibble's values·2^-126 FP32 [BN, BK/2], scales FP32 [BN, BK/32] -> BF16 weights."""
    w = tl.reshape(v * _TWO126, (BN, BK // 32, 16)) * s[:, :, None]        # exact, no overflow
    return tl.reshape(w, (BN, BK // 2)).to(tl.bfloat16)


@triton.jit
def _tile_codes(W, S, w_off, s_off, k0, rb, rg, n_ok):
    """One K tile's packed bytes uint8 [BN, BK/2] and scales 2^(e-127) FP32 [BN, BK/32]."""
    b = tl.load(W + w_off + k0 // 2 + rb[None, :], mask=n_ok[:, None], other=0)
    return b, _pow2(tl.load(S + s_off + k0 // 32 + rg[None, :], mask=n_ok[:, None], other=0))


@triton.jit
def _dot_tile(W, S, w_off, s_off, k0, rb, rg, n_ok, a_lo, a_hi, acc, F32: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """DEQ 0: acc [BM, BN] + a_lo·W_evenᵀ + a_hi·W_oddᵀ over one K tile (BF16 MMA, FP32 acc)."""
    b, s = _tile_codes(W, S, w_off, s_off, k0, rb, rg, n_ok)
    b = b.to(tl.int32)
    acc = dot_bf16(a_lo, tl.trans(_dequant_half(_e2m1_lo(b), s, BN, BK)), acc, F32)
    return dot_bf16(a_hi, tl.trans(_dequant_half(_e2m1_hi(b), s, BN, BK)), acc, F32)


# _pair_tile's PTX, per 4 bytes ($4; byte i = elements 2i, 2i+1 as low / high nibble): two prmt
# put bytes 0, 1 (2, 3) under the two 16-bit lanes; a masked nibble times 2^12 + 2^6 (low) or
# 2^8 + 2^2 (high) lands its sign at bit 15 and its exponent / mantissa bits at 8-6 of its
# lane (no carries: the two copies do not overlap), the mask keeps those: BF16 e2m1·2^-126
# (E = 0 codes as BF16 subnormals), then fma.rn.bf16x2 by 2^126 and by the group's 2^(e-127)
# ($5, $6: the scales of bytes 0, 1 and 2, 3), both exact. $0, $1: low nibbles of bytes 0-1,
# 2-3; $2, $3: the high ones. 1.75 integer ops and 1 BF16 FMA a weight, no I2F / F2F.
_PAIR_ASM = tl.constexpr(
    "{ .reg .b32 r01, r23, t, big, nz;"
    " mov.b32 big, 0x7E807E80; mov.b32 nz, 0x80008000;"
    " prmt.b32 r01, $4, 0, 0x4140; prmt.b32 r23, $4, 0, 0x4342;"
    " and.b32 t, r01, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 $0, t, 0x81C081C0;"
    " and.b32 t, r23, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 $1, t, 0x81C081C0;"
    " and.b32 t, r01, 0x00F000F0; mul.lo.u32 t, t, 0x0104; and.b32 $2, t, 0x81C081C0;"
    " and.b32 t, r23, 0x00F000F0; mul.lo.u32 t, t, 0x0104; and.b32 $3, t, 0x81C081C0;"
    " fma.rn.bf16x2 $0, $0, big, nz; fma.rn.bf16x2 $1, $1, big, nz;"
    " fma.rn.bf16x2 $2, $2, big, nz; fma.rn.bf16x2 $3, $3, big, nz;"
    " fma.rn.bf16x2 $0, $0, $5, nz; fma.rn.bf16x2 $1, $1, $6, nz;"
    " fma.rn.bf16x2 $2, $2, $5, nz; fma.rn.bf16x2 $3, $3, $6, nz; }")


@triton.jit
def _pair_tile(W, S, w_off, s_off, k0, rb, rg, n_ok, F32: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    """DEQ 2: one K tile of codes -> BF16 weights [BN, BK] in input order (element 2j, 2j+1 =
    byte j's low, high nibble: one dot with the activations as loaded, no even / odd split);
    _PAIR_ASM on a GPU, _dequant_half's FP32 steps in the interpreter (no inline PTX)."""
    b, s = _tile_codes(W, S, w_off, s_off, k0, rb, rg, n_ok)
    if F32:
        lo = _dequant_half(_e2m1_lo(b.to(tl.int32)), s, BN, BK)
        hi = _dequant_half(_e2m1_hi(b.to(tl.int32)), s, BN, BK)
    else:
        sb = tl.reshape(tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BN, BK // 32, 16)),
                        (BN, BK // 2))                                       # a byte's scale
        lo, hi = tl.inline_asm_elementwise(_PAIR_ASM, "=r,=r,=r,=r,r,r,r", [b, sb],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@triton.jit
def _mx4_sorted_kernel(A, SORTED, BLOCK_E, RW, W1, S1, W3, S3, OUT, N, K, TOPK, P, E,
                       GATED: tl.constexpr, BY_SLOT: tl.constexpr, LIMIT: tl.constexpr,
                       F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       DEQ: tl.constexpr = 0):
    """Block b (BM slots of one expert) x rows [pid_n·BN, +BN). A rows by slot (BY_SLOT: the
    down projection reads h) or by pair // k (x). GATED -> h [slots, N] at the slot; else
    out [P, N] at the pair. DEQ 0: FP32 decoding, even / odd inputs in two dots a K tile
    (_dot_tile); 2: BF16 pairs in input order from PTX, one dot (_pair_tile; the int8 sorted
    kernel's K order: its results equal that kernel's at the same tile, bit for bit in the
    interpreter, within one BF16 ulp in 1-2 outputs of thousands compiled, test_moe_mx4.py)."""
    b, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_E + b)
    if e >= E:
        return                                               # past the real block count
    e = e.to(tl.int64)
    slots = b * BM + tl.arange(0, BM)
    pair = tl.load(SORTED + slots)
    valid = pair < P                                         # padding slots hold P
    arow = slots if BY_SLOT else pair // TOPK
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rb = tl.arange(0, BK // 2)
    rg = tl.arange(0, BK // 32)
    n_ok = rn < N
    KB, KG = (K // 64) * 32, (K // 64) * 2                  # = K/2, K/32 (K % 64 == 0), aligned
    w_off = e * N * KB + rn[:, None] * KB
    s_off = e * N * KG + rn[:, None] * KG
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + arow[:, None].to(tl.int64) * K + k0 + rk[None, :], mask=valid[:, None],
                    other=0.0)                                                # [BM, BK] bf16
        if DEQ == 2:
            w = _pair_tile(W1, S1, w_off, s_off, k0, rb, rg, n_ok, F32, BN, BK)
            acc1 = dot_bf16(a, tl.trans(w), acc1, F32)
            if GATED:
                w = _pair_tile(W3, S3, w_off, s_off, k0, rb, rg, n_ok, F32, BN, BK)
                acc3 = dot_bf16(a, tl.trans(w), acc3, F32)
        else:
            a_lo, a_hi = tl.split(tl.reshape(a, (BM, BK // 2, 2)))           # even / odd inputs
            acc1 = _dot_tile(W1, S1, w_off, s_off, k0, rb, rg, n_ok, a_lo, a_hi, acc1, F32, BN,
                             BK)
            if GATED:
                acc3 = _dot_tile(W3, S3, w_off, s_off, k0, rb, rg, n_ok, a_lo, a_hi, acc3, F32,
                                 BN, BK)
    mask = valid[:, None] & n_ok[None, :]
    if GATED:
        wr = tl.load(RW + pair, mask=valid, other=0.0)
        h = _swiglu(acc1, acc3, wr[:, None], LIMIT)
        tl.store(OUT + slots[:, None].to(tl.int64) * N + rn[None, :], h.to(tl.bfloat16), mask=mask)
    else:
        tl.store(OUT + pair[:, None].to(tl.int64) * N + rn[None, :], acc1.to(tl.bfloat16),
                 mask=mask)


# BK counts inputs (BK/2 bytes per row and tile); the decode tile reads as many bytes per
# iteration as the int8 kernel's. Sorted tiles: the int8 shapes (A dominates shared memory).
# Decode: DECODE_TABLE rows (max pairs, config) as kernels.moe.int8's (the table printed by
# `bench_kernels.py --moe-decode-sweep` for mx4_e2m1 is pasted here); variants "base"
# (_mx4_gemv_kernel: its tiles are already [BN, BK/32, 16] groups) and "prefetch".
# best of the H200 sweep (2026-12-01, commit 16bc670): M=1 69.8 us (gate/up and down apart).
# H200 sweep at commit 213e741 (word, mma added; int8's best 60.4 us in the same run): M=1
# fused best mma BN32 BK512 w2 s2 57.4 us (M=2/4/8 101.5/163.3/312.2 vs int8 106.4/191.7/365.0);
# split M<=2 word BN16 BK1024 w4 s2 gate/up + mma BN32 BK512 w2 s2 down 56.1 us. The fused mma
# tile is the default since 2026-12-01 (one config for both launches, every M measured faster
# than int8's best; the old base tiles: 79.4 us at M = 1). 2026-12-01 (`bench_kernels.py
# --moe-decode-sweep --pipe`, H200, Triton 3.6): the same tile with its K loop as a 3-deep cp.async
# pipeline (STAGES 3, num_stages 3) 63.7 -> 54.9 us at M = 1, 118.7 / 187.7 / 355.3 -> 95.8 /
# 160.1 / 301.6 at M = 2 / 4 / 8, against int8's best 59.4 / 105.4 / 192.9 / 362.8 in that run.
# 2026-12-02, one TP-4 rank (I = 512; `.whl` probe, H200, graph-timed over 4 routings): that tile
# gives gate/up 96 programs, 24.4 us at M = 1 for 3.2 us of bytes; word BN 4 BK 512 on 1 warp
# 15.3 us (64.3 at M = 8, the mma tile 64.6: kept there), down mma BN 64 on 4 warps 6.5 (7.4).
# 2026-12-02 (`bench_kernels.py --moe-decode-sweep --occ --schemes mx4_e2m1`, tp 1, H200, Triton
# 3.6): 13 tiles of fewer weights a program (word / base BN 2-8, mma on 1 warp) against the
# shipped mma tile (54.5 us at M = 1: gate/up 36.9 + down 18.1 alone): none streams faster than
# ~1.5 TB/s (the decode is bound by its instructions a weight, not by the grid as int8's was);
# the best gate/up, word BN 8 BK 256 on 1 warp (33.7 us), with the mma down: 51.8 us (M = 2:
# 89.1 vs 91.2 fused at BK 256, 97.4 at BK 512). In the step that row LOST: bench_ab.py
# --experts mx4, batch 1, +25 us (GPU time of the replay, same process): not taken.
# 2026-12-06 (`--moe-decode-sweep --moe-tp 4 --schemes mx4_e2m1`, H100): 12 more tiles, whole
# rows in one K step (word BK 2048 / 4096 on 2-8 warps) and fewer rows a down program: gate/up
# 15.4-22.5 us against the shipped word tile's 15.2, down 7.6-16.1 against mma BN 64's 6.5.
# 2026-12-06, split-K (K in 2-8 parts, a program each, the row block's last program summing the
# parts; code at 4174fb9): 19 tiles, gate/up at best 14.2 us (word BN 8 BK 512, 1 warp, 4 parts)
# against the shipped 15.1 in that run; in the slice's step -10.9 us at batch 1: noise, reverted.
# Four times the warps did not help: the gate/up is not bound by the warps an SM holds.
# 2026-12-06 (H100, ncu): the word tile issues 0.44 instructions a cycle a scheduler with 1.45
# warps on each; its PTX moves the inputs of every nibble through shared memory (8 bar.sync a
# K tile). The "word4d" variant loads a K tile's inputs once, as 16-byte runs: gate/up
# 14.55 -> 10.65 us alone (word4d BN 1 BK 2048, 1 warp, best of 15 tiles; same bits at this
# shape); down word4d 7.04 vs mma 7.32. In the slice's step (bench_ab.py --layers 43 --tp-shard 4
# --experts mx4, same process, GPU time of the replay): gate/up -236.2 us at batch 1 (-2.7 at
# batch 8, where this row does not apply); with the word4d down too -244.7 (+14.0 at batch 8):
# the down stays mma.
DECODE_TABLE = ((6, 512, dict(variant="word4d", BN=1, BK=2048, num_warps=1, num_stages=2,
                              STAGES=1, down=dict(variant="mma", BN=64, BK=512, num_warps=4,
                                                  num_stages=3, STAGES=3))),
                (DECODE_PAIRS, dict(variant="mma", BN=32, BK=512, num_warps=2, num_stages=3,
                                    STAGES=3)))
DECODE_VARIANTS = ("base", "prefetch", "word", "word4d", "mma")
# The down launch summing each token's pairs (common.launch_down_sum: no combine launch; a
# program per (token, BN rows), the TOPK pairs in turn): None = off, else a tile of
# mx4_decode.SUM_ROWS' variants and "max_pairs" (decode launches of at most that many pairs;
# at tp 1 the decode Block leaves the sum to hc_post, so this applies at tp > 1). H200, 43-layer
# TP-4 slice, bench_ab.py (2026-12-07, GPU time of the replay, against the mma down + combine):
# word4d BN 2 BK 512 on 1 warp -32.5 / -43.6 us at batch 1 (two processes); BN 8 BK 256 +228.6;
# BN 4 BK 512 +74.9 at batch 1 and +245.7 at batch 8 (48 pairs), so batch 1 only. int8's (its
# base variant, BN 2 / 4 / 8) did not win: moe.int8.DOWN_SUM.
DOWN_SUM: dict | None = dict(variant="word4d", BN=2, BK=512, num_warps=1, max_pairs=6)


def decode_config(K: int, P: int = 1, down: bool = False, I: int | None = None) -> dict:
    """common.decode_config on this scheme's DECODE_TABLE."""
    return common.decode_config(K, P, DECODE_TABLE, down, I)


_GEMV4 = {name: (kern, dict(F32=interpreted()) if name == "mma" else {})
          for name, kern in GEMV_KERNELS.items()}


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"fused_moe: {name} must be contiguous torch.uint8{list(shape)} (mx4), "
                         f"got {t.dtype}{list(t.shape)}")


def fused_moe_mx4(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
                  s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
                  s2: torch.Tensor, limit: float, path: str | None = None,
                  config: dict | None = None, shared: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32,
                  shared_ready: torch.cuda.Event | None = None, pairs: bool = False):
    """fused_moe_int8 for mx4_e2m1 stacks (kernels.moe.fused_moe dispatches here on uint8 w1): x
    [T, K] bf16,
    idx/w [T, k] -> routed-expert sum [T, D] (+ shared) in `dtype`, summed in FP32 (pairs: its
    inputs as a pointwise.PairSum, as fused_moe)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"fused_moe: x must be bf16 [T, K], got {x.dtype}{list(x.shape)}")
    E, I, KB = w1.shape
    K, D = 2 * KB, w2.shape[1]
    for name, t, shape in (("w1", w1, (E, I, KB)), ("w3", w3, (E, I, KB)),
                           ("s1", s1, (E, I, K // MX_GROUP)), ("s3", s3, (E, I, K // MX_GROUP)),
                           ("w2", w2, (E, D, I // 2)), ("s2", s2, (E, D, I // MX_GROUP))):
        _check(name, t, shape)
    return run_moe(x, idx, w, (w1, s1, w3, s3, w2, s2), (E, I, K, D), limit, path, config,
                   _GEMV4, DECODE_TABLE, _mx4_sorted_kernel,
                   (dict(BY_SLOT=False), dict(BY_SLOT=True)), shared, dtype, shared_ready,
                   down_tile=False, pairs=pairs,            # mx4's tiles were not swept
                   down_sum=(SUM_ROWS, DOWN_SUM))


def mx4_linear_pairs(a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                     path: str = "decode", config: dict | None = None) -> torch.Tensor:
    """One projection through the MoE kernels: a [P, K] bf16, row p times expert ids[p]'s
    weight -> bf16 [P, N] (tests: with one-hot rows it returns the decoded weights)."""
    E, N, KB = w.shape
    P, K = a.shape
    _check("w", w, (E, N, KB))
    _check("s", s, (E, N, K // MX_GROUP))
    if K != 2 * KB or K % 64 or ids.shape != (P,):
        raise ValueError(f"mx4_linear_pairs: a {list(a.shape)}, ids {list(ids.shape)}, "
                         f"w {list(w.shape)}")
    a, out = a.contiguous(), torch.empty(P, N, dtype=torch.bfloat16, device=a.device)
    one = torch.ones(P, dtype=torch.float32, device=a.device)
    if path == "decode":
        c = {**decode_config(K, P), **(config or {})}
        launch_decode(_GEMV4, P, N, K, c, (a, ids.to(torch.int32).contiguous(), one, w, s, w, s,
                                            out, N, K, 1), GATED=False, LIMIT=0.0)
    elif path == "sorted":
        cfg = {**sorted_config(P, down=False), **(config or {})}
        sorted_ids, block_e = align(ids[:, None], E, cfg["BM"])
        _mx4_sorted_kernel[(block_e.numel(), triton.cdiv(N, cfg["BN"]))](
            a, sorted_ids, block_e, one, w, s, w, s, out, N, K, 1, P, E, GATED=False,
            BY_SLOT=False, LIMIT=0.0, F32=interpreted(), **dict(cfg, BK=fit_bk(K, cfg["BK"])))
    else:
        raise ValueError(f"mx4_linear_pairs: unknown path {path!r}")
    return out
