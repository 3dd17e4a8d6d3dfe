"""The decode GEMVs of the int8_mx32 fused MoE (kernels.moe.int8; the math is in its docstring): one
program per (pair, BN output rows) for up to DECODE_PAIRS pairs, and the int8_mx32 helpers the
sorted kernel shares (_dequant_mx, _dequant_bf16, _pow2_mx).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backfit.runtime.kernels.common import MAGIC_F, MAGIC_I
from backfit.runtime.kernels.moe.common import _pair_program, _pair_store

__all__ = ["SUM_ROWS"]


@triton.jit
def _dequant_mx(q, e, BN: tl.constexpr, BK: tl.constexpr):
    """q int8 [BN, BK], e uint8 [BN, BK/32] -> q·2^(e-128) as FP32 [BN, BK]. The scale from
    bits (_pow2_mx): tl.exp2 flushed 2^-128 and 2^-127 (bytes 0, 1) to 0 on the H200."""
    s = _pow2_mx(e)                                                            # [BN, BK/32]
    w = tl.reshape(q.to(tl.float32), (BN, BK // 32, 32)) * s[:, :, None]
    return tl.reshape(w, (BN, BK))


_BF16_192 = tl.constexpr(0x4340)     # BF16 bits of 192: + q (|q| <= 63) = the bits of 192 + q

# _dequant_bf16's PTX, per 4 codes (one 32-bit register $4, byte i = code i): each byte to q + 64
# (xor 0x80 = q + 128 without borrows, minus 64), two prmt put bytes 0,1 / 2,3 under the BF16
# high byte 0x43 (= 192 + q, two lanes each), then per lane pair fma.rn.bf16x2 (x·1 - 192 = q,
# then q·s - 0 = q·2^(e-128); both exact). $2, $3: the pairs' scales [s, s] (one 32-group).
_DEQ_ASM = tl.constexpr(
    "{ .reg .b32 t, one, off, nz;"
    " mov.b32 one, 0x3F803F80; mov.b32 off, 0xC340C340; mov.b32 nz, 0x80008000;"
    " xor.b32 t, $4, 0x80808080; sub.u32 t, t, 0x40404040;"
    " prmt.b32 $0, t, 0x43434343, 0x5140; prmt.b32 $1, t, 0x43434343, 0x7362;"
    " fma.rn.bf16x2 $0, $0, one, off; fma.rn.bf16x2 $1, $1, one, off;"
    " fma.rn.bf16x2 $0, $0, $2, nz; fma.rn.bf16x2 $1, $1, $3, nz; }")


@triton.jit
def _dequant_bf16(q, e, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """q int8 [BN, BK] (|q| <= 63; the format's codes are <= 12), e uint8 [BN, BK/32] -> BF16
    q·2^(e-128), exact, without an int -> float conversion: 192 + q as BF16 bits (an integer
    add a weight), minus 192 and times the group's 2^(e-128) in BF16 (fma.rn.bf16 on sm_80;
    both steps exact: q and q·2^(e-128) are BF16 values wherever the latter is finite). The
    I2F + F2F of _dequant_mx run at a quarter of the FP32 rate and bound the sorted kernel
    where an expert has few rows (each weight is dequantized for few MMA rows). 4 codes a step
    in PTX (_DEQ_ASM: 2.5 instructions a weight, BF16 pairs; the same steps as Triton BF16 ops
    compile to scalar fma.rn.bf16, and ran 11 % slower at batch-64 decode on the H200). F32
    (the interpreter: no inline PTX, and its BF16 arithmetic on bitcast values is wrong): the
    same bits widened to FP32 and the same two exact steps there."""
    s = _pow2_mx(e)                                                            # [BN, BK/32]
    q = tl.reshape(q, (BN, BK // 32, 32))
    if F32:
        bits = q.to(tl.int32) + _BF16_192                                      # 192 + q
        w192 = (bits << 16).to(tl.float32, bitcast=True)
        w = ((w192 - 192.0) * s[:, :, None]).to(tl.bfloat16)
    else:
        sb = tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BN, BK // 32, 32))
        w = tl.inline_asm_elementwise(_DEQ_ASM, "=r,=r,r,r,r", [sb, q], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    return tl.reshape(w, (BN, BK))


@triton.jit
def _base_rows(A, arow, W1, S1, W3, S3, e, rn, n_ok, N, K, GATED: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """Variant "base": FP32 [BN] row sums of expert e's rows rn · A[arow] (and W3's, GATED),
    [BN, BK] tiles dequantized through a [BN, BK/32, 32] reshape. STAGES > 1: the K loop's
    loads go through a cp.async pipeline that deep (see STAGES below)."""
    rk = tl.arange(0, BK)
    rg = tl.arange(0, BK // 32)
    KG = K // 32
    w_off = e * N * K + rn[:, None] * K                     # [BN, 1] int64
    s_off = e * N * KG + rn[:, None] * KG
    acc1 = tl.zeros((BN,), dtype=tl.float32)
    acc3 = tl.zeros((BN,), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(A + arow * K + k0 + rk).to(tl.float32)                   # [BK]
        q = tl.load(W1 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(S1 + s_off + k0 // 32 + rg[None, :], mask=n_ok[:, None], other=0)
        acc1 += tl.sum(_dequant_mx(q, s, BN, BK) * a[None, :], axis=1)       # exact BF16 values
        if GATED:
            q = tl.load(W3 + w_off + k0 + rk[None, :], mask=n_ok[:, None], other=0)
            s = tl.load(S3 + s_off + k0 // 32 + rg[None, :], mask=n_ok[:, None], other=0)
            acc3 += tl.sum(_dequant_mx(q, s, BN, BK) * a[None, :], axis=1)
    return acc1, acc3


@triton.jit
def _moe_gemv_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK,
                     GATED: tl.constexpr, LIMIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr = 1):
    """Pair p, rows [pid_n·BN, +BN) of expert idx[p]: GATED -> h [P, N], else out [P, N] (bf16)
    (_base_rows)."""
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    r1, r3 = _base_rows(A, arow, W1, S1, W3, S3, e, rn, n_ok, N, K, GATED, BN, BK, STAGES)
    _pair_store(OUT, RW, p, N, rn, n_ok, r1, r3, GATED, LIMIT)


# Decode GEMV variants (config key "variant"; docs/KERNELS.md; bench_kernels.py --moe-decode-sweep)
#   base      _moe_gemv_kernel: [BN, BK] tiles dequantized through a [BN, BK/32, 32] reshape.
#   group     _moe_gemv_group_kernel MODE 0: tiles loaded as [BN, BK/32, 32] (no reshape), group
#             sums Σ_j q·x (exact products) times 2^(e-128) once per group, [BN, BK/32] partials
#             across K, one cross-group sum at the end.
#   magic     MODE 1: group without I2F (16/clk/SM): bits(1.5·2^23) + q is the float 1.5·2^23 + q,
#             minus 1.5·2^23 exact; 2^(e-128) built from bits, not ex2 (exact, subnormals too).
#   fma       MODE 2: magic's codes, each weight dequantized by one exact FMA, (1.5·2^23 + q)·2^e
#             − 1.5·2^23·2^e (exact products and difference; finite for e <= 231, |w| <= 12·2^103),
#             FMA-accumulated per element.
#   prefetch  magic + the next K tile's loads issued before this tile's math (double-buffered in
#             registers; a CUDA-core GEMV gets no cp.async pipelining).
# FP32 accumulation in all; the same bf16 roundings (only the summation order moves).
# STAGES (config key, every variant): the K loop as tl.range(num_stages=STAGES). Triton pipelines
# loads through shared memory (cp.async, STAGES - 1 tiles in flight) only for loads feeding a
# tl.dot or for a loop that asks: with a plain range (STAGES = 1) every K step of these CUDA-core
# GEMVs waits for its own loads, and bytes in flight are bounded by the resident programs
# (the sm_80 PTX of the launch option num_stages = 3 alone has no cp.async). Same math.


@triton.jit
def _pow2_mx(s):
    """Exponent bytes (any shape) -> FP32 2^(s-128) from bits, exact (subnormal for s <= 1)."""
    e = s.to(tl.int32)
    bits = tl.where(e > 1, (e - 1) << 23, (e + 1) << 21)       # e = 0, 1: 2^-128, 2^-127 (subnormal)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _acc_tile(acc, q, s, a, MODE: tl.constexpr):
    """acc + one tile: q int8/int32 codes [BN, G, 32], s exponent bytes [BN, G], a FP32 [1, G, 32];
    acc [BN, G] group sums (MODE 0, 1) or [BN, G, 32] per-element FMAs (MODE 2)."""
    if MODE == 0:
        acc += tl.sum(q.to(tl.float32) * a, axis=2) * _pow2_mx(s)
    else:
        qf = (q.to(tl.int32) + MAGIC_I).to(tl.float32, bitcast=True)          # 1.5·2^23 + q
        if MODE == 1:
            acc += tl.sum((qf - MAGIC_F) * a, axis=2) * _pow2_mx(s)
        else:
            sc = _pow2_mx(s)[:, :, None]
            acc += (qf * sc - MAGIC_F * sc) * a
    return acc


@triton.jit
def _acc_rows(acc, MODE: tl.constexpr):
    """_acc_tile's accumulator -> FP32 [BN] row sums."""
    if MODE == 2:
        acc = tl.sum(acc, axis=2)
    return tl.sum(acc, axis=1)


@triton.jit
def _moe_gemv_group_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK, GATED: tl.constexpr,
                           LIMIT: tl.constexpr, MODE: tl.constexpr, PREFETCH: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr = 1):
    """_moe_gemv_kernel's contract, tiles [BN, BK/32, 32] (variants group / magic / fma /
    prefetch; STAGES as there). Prefetched codes are carried as int32 (an int8 loop-carried tile costs byte
    repacking instructions)."""
    G: tl.constexpr = BK // 32
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    rg = tl.arange(0, G)
    rj = tl.arange(0, 32)
    m3, m2 = n_ok[:, None, None], n_ok[:, None]
    KG = K // 32
    w_off = e * N * K + rn[:, None, None] * K + rg[None, :, None] * 32 + rj[None, None, :]
    s_off = e * N * KG + rn[:, None] * KG + rg[None, :]                        # [BN, G]
    a_off = arow * K + rg[:, None] * 32 + rj[None, :]                          # [G, 32]
    if MODE == 2:
        acc1 = tl.zeros((BN, G, 32), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros_like(acc1)
    if PREFETCH:                                  # tile k0 = 0 (BK divides K)
        q1 = tl.load(W1 + w_off, mask=m3, other=0).to(tl.int32)
        s1 = tl.load(S1 + s_off, mask=m2, other=0)
        q3, s3 = q1, s1
        if GATED:
            q3 = tl.load(W3 + w_off, mask=m3, other=0).to(tl.int32)
            s3 = tl.load(S3 + s_off, mask=m2, other=0)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(A + a_off + k0).to(tl.float32)[None, :, :]                 # [1, G, 32]
        nk = tl.minimum(k0 + BK, K - BK) if PREFETCH else k0   # last prefetch: itself (L1)
        q1n = tl.load(W1 + w_off + nk, mask=m3, other=0)
        s1n = tl.load(S1 + s_off + nk // 32, mask=m2, other=0)
        q3n, s3n = q1n, s1n
        if GATED:
            q3n = tl.load(W3 + w_off + nk, mask=m3, other=0)
            s3n = tl.load(S3 + s_off + nk // 32, mask=m2, other=0)
        if PREFETCH:
            q1n, q3n = q1n.to(tl.int32), q3n.to(tl.int32)
            acc1 = _acc_tile(acc1, q1, s1, a, MODE)
            if GATED:
                acc3 = _acc_tile(acc3, q3, s3, a, MODE)
            q1, s1, q3, s3 = q1n, s1n, q3n, s3n
        else:
            acc1 = _acc_tile(acc1, q1n, s1n, a, MODE)
            if GATED:
                acc3 = _acc_tile(acc3, q3n, s3n, a, MODE)
    _pair_store(OUT, RW, p, N, rn, n_ok, _acc_rows(acc1, MODE), _acc_rows(acc3, MODE), GATED,
                LIMIT)


SUM_ROWS = dict(base=_base_rows)        # common._down_sum_kernel's ROWS by variant
