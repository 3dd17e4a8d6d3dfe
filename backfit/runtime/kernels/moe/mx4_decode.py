"""The decode GEMVs of the 4-bit fused MoE (kernels.moe.mx4; the math is in its docstring and in
kernels.moe.int8's): one program per (pair, BN output rows), for up to DECODE_PAIRS pairs, and the
register decoding of e2m1 nibbles they share with the sorted kernel. Variants (config "variant",
moe_mx4.DECODE_TABLE):
  base      byte tiles [BN, BK/32, 16], even / odd activations loaded apart, group sums in FP32
  prefetch  base with the next K tile loaded one iteration ahead
  word      int32 words, 8 nibbles each, a nibble to FP32 in 3 integer ops
  word4d    word with the 8 nibbles of a word on a 4th tile axis: a K tile's inputs loaded once,
            no shared-memory round trip a nibble
  mma       two BF16 weights per int32 in 13 ops per 8, BF16 tensor cores with each 32-group in
            its own MMA row, so the group's 2^(e-127) is one FP32 multiply per row (the E = 0
            codes ±0.5 enter the MMA as BF16 subnormals, which the H200 keeps:
            test_decode_variants_exact_and_match passed there, 2026-12-01)
"""

from __future__ import annotations

import triton
import triton.language as tl

from backfit.runtime.kernels.common import dot_bf16
from backfit.runtime.kernels.moe.common import _pair_program, _pair_store

__all__ = ["GEMV_KERNELS", "SUM_ROWS"]


@triton.jit
def _pow2(e):
    """UE8M0 bytes uint8 (any shape) -> FP32 2^(e-127), exact (e = 255 gives inf, as ldexp)."""
    e = e.to(tl.int32)
    return tl.where(e > 0, e << 23, 1 << 22).to(tl.float32, bitcast=True)


# A nibble n lands in the FP32 exponent LSBs / top mantissa bit / sign with one multiply and one
# mask: (n·(2^22 + 2^28)) & 0x81C00000 = e2m1(n)·2^-126 exactly (E = 0 codes become FP32
# subnormals of the same scale; no FTZ anywhere, test_sm80_moe_mx4 checks the PTX).
_SIGN_EXP_MAN = tl.constexpr(-0x7E400000)     # 0x81C00000 as int32: bits 31, 24, 23, 22
_TWO63 = tl.constexpr(9223372036854775808.0)  # 2^63
_TWO126 = tl.constexpr(2.0 ** 126)


@triton.jit
def _e2m1_lo(b):
    """Packed bytes int32 [...] -> FP32 e2m1 value of the low nibble (element 2j) · 2^-126."""
    return (((b & 15) * 0x10400000) & _SIGN_EXP_MAN).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_hi(b):
    """Packed bytes int32 [...] -> FP32 e2m1 value of the high nibble (element 2j+1) · 2^-126."""
    return (((b & 0xF0) * 0x01040000) & _SIGN_EXP_MAN).to(tl.float32, bitcast=True)


# GEMV: the activations carry 2^63 and each 32-group sum gets 2^63 back with 2^(e-127), so
# products and sums are the plain ones times a power of two: the same FP32 results for
# |x| < 2^65 and |w·x| >= 2^-63.
@triton.jit
def _gemv_groups(W, S, w_off, s_off, k0, n_ok, a_lo, a_hi):
    """Per-32-group sums of w·x over one K tile -> FP32 [BN, G]: w_off [BN, G, 16] byte offsets,
    s_off [BN, G], a_lo/a_hi [G, 16] = even/odd inputs · 2^63."""
    b = tl.load(W + w_off + k0 // 2, mask=n_ok[:, None, None], other=0).to(tl.int32)
    t = tl.sum(_e2m1_lo(b) * a_lo[None] + _e2m1_hi(b) * a_hi[None], axis=2)      # ·2^-63
    s = tl.load(S + s_off + k0 // 32, mask=n_ok[:, None], other=0)
    return t * _TWO63 * _pow2(s)


@triton.jit
def _mx4_gemv_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK,
                     GATED: tl.constexpr, LIMIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr = 1):
    """Pair p, rows [pid_n·BN, +BN) of expert idx[p]: GATED -> h [P, N], else out [P, N] (bf16).
    GATED reads x[p // TOPK], else A[p]. Tiles [BN, BK/32, 16] bytes (one 16-byte vector per
    row and group), group sums accumulated [BN, BK/32] across K, one cross-group sum at the end."""
    G: tl.constexpr = BK // 32
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    rg = tl.arange(0, G)
    rj = tl.arange(0, 16)                                   # byte j of a group: inputs 2j, 2j+1
    KB, KG = (K // 64) * 32, (K // 64) * 2                  # = K/2, K/32 (K % 64 == 0), aligned
    w_off = (e * N * KB + rn[:, None, None] * KB + rg[None, :, None] * 16
             + rj[None, None, :])                           # [BN, G, 16] int64
    s_off = e * N * KG + rn[:, None] * KG + rg[None, :]     # [BN, G]
    a_off = arow * K + rg[:, None] * 32 + 2 * rj[None, :]   # [G, 16] even inputs
    acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros((BN, G), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a_lo = tl.load(A + a_off + k0).to(tl.float32) * _TWO63
        a_hi = tl.load(A + a_off + k0 + 1).to(tl.float32) * _TWO63
        acc1 += _gemv_groups(W1, S1, w_off, s_off, k0, n_ok, a_lo, a_hi)
        if GATED:
            acc3 += _gemv_groups(W3, S3, w_off, s_off, k0, n_ok, a_lo, a_hi)
    _pair_store(OUT, RW, p, N, rn, n_ok, tl.sum(acc1, axis=1), tl.sum(acc3, axis=1), GATED,
                LIMIT)


@triton.jit
def _mx4_groups(b, s, a_lo, a_hi):
    """_gemv_groups on loaded bytes b int32 [BN, G, 16] and exponents s [BN, G] -> FP32 [BN, G]."""
    t = tl.sum(_e2m1_lo(b) * a_lo[None] + _e2m1_hi(b) * a_hi[None], axis=2)      # ·2^-63
    return t * _TWO63 * _pow2(s)


@triton.jit
def _mx4_gemv_prefetch_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK, GATED: tl.constexpr,
                              LIMIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              STAGES: tl.constexpr = 1):
    """_mx4_gemv_kernel (variant "prefetch", as kernels.moe.int8's): the next K tile's bytes and
    exponents are loaded (as int32) before this tile's math; the last tile reloads itself."""
    G: tl.constexpr = BK // 32
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    rg = tl.arange(0, G)
    rj = tl.arange(0, 16)
    m3, m2 = n_ok[:, None, None], n_ok[:, None]
    KB, KG = (K // 64) * 32, (K // 64) * 2
    w_off = e * N * KB + rn[:, None, None] * KB + rg[None, :, None] * 16 + rj[None, None, :]
    s_off = e * N * KG + rn[:, None] * KG + rg[None, :]
    a_off = arow * K + rg[:, None] * 32 + 2 * rj[None, :]
    acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros((BN, G), dtype=tl.float32)
    b1 = tl.load(W1 + w_off, mask=m3, other=0).to(tl.int32)
    s1 = tl.load(S1 + s_off, mask=m2, other=0)
    b3, s3 = b1, s1
    if GATED:
        b3 = tl.load(W3 + w_off, mask=m3, other=0).to(tl.int32)
        s3 = tl.load(S3 + s_off, mask=m2, other=0)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a_lo = tl.load(A + a_off + k0).to(tl.float32) * _TWO63
        a_hi = tl.load(A + a_off + k0 + 1).to(tl.float32) * _TWO63
        nk = tl.minimum(k0 + BK, K - BK)                    # next tile (inputs)
        b1n = tl.load(W1 + w_off + nk // 2, mask=m3, other=0).to(tl.int32)
        s1n = tl.load(S1 + s_off + nk // 32, mask=m2, other=0)
        b3n, s3n = b1n, s1n
        if GATED:
            b3n = tl.load(W3 + w_off + nk // 2, mask=m3, other=0).to(tl.int32)
            s3n = tl.load(S3 + s_off + nk // 32, mask=m2, other=0)
        acc1 += _mx4_groups(b1, s1, a_lo, a_hi)
        if GATED:
            acc3 += _mx4_groups(b3, s3, a_lo, a_hi)
        b1, s1, b3, s3 = b1n, s1n, b3n, s3n
    _pair_store(OUT, RW, p, N, rn, n_ok, tl.sum(acc1, axis=1), tl.sum(acc3, axis=1), GATED,
                LIMIT)


# Packed-word decode (variants "word", "mma"; bench_kernels.py --moe-decode-sweep
# ranks them): the codes are read as int32 words, 8 nibbles each (nibble i, bits 4i..4i+3 =
# element 8j + i of word j, little endian), so no byte is extracted, and each value is put in
# place by shifts, masks and multiplies of the whole word (sm_90 SASS, hot loop: base 5.9
# instructions a weight, word 4.7, mma 2.9 at BN 32).
_SIGN16 = tl.constexpr(-0x7FFF8000)           # 0x80008000: the sign of both BF16 lanes
_MAG16 = tl.constexpr(0x01C001C0)             # BF16 bits 8, 7, 6 of both lanes
_SIGN_MAN16 = tl.constexpr(-0x7E3F7E40)       # 0x81C081C0: both


@triton.jit
def _shl(w, n: tl.constexpr):
    """w << n for n >= 0, w >> -n (arithmetic; callers mask the filled bits away) otherwise."""
    if n >= 0:
        return w << n
    return w >> (-n)


@triton.jit
def _nib_f32(w, i: tl.constexpr):
    """int32 words -> FP32 e2m1 value · 2^-126 of nibble i (3 integer ops, 2 for i = 7): the
    nibble's sign moved to bit 31, an arithmetic shift by 6 puts its 3 magnitude bits at 22-24
    and copies the sign over bits 25-30, which the mask clears."""
    return ((_shl(w, 28 - 4 * i) >> 6) & _SIGN_EXP_MAN).to(tl.float32, bitcast=True)


@triton.jit
def _nib_pair(w, q: tl.constexpr):
    """int32 words -> int32 holding two BF16 e2m1 values · 2^-126: nibble q in the low lane,
    nibble q + 4 in the high lane. q = 0, 1: masked nibbles times 2^a + 2^(a+6) land magnitude
    and sign at once (lanes cannot carry into each other); q = 2 is q = 0 of w >> 8; q = 3: the
    sign bits are in place, the magnitudes shift down 6 (13 integer ops per 8 weights)."""
    if q == 0:
        v = ((w & 0x000F000F) * 0x1040) & _SIGN_MAN16
    elif q == 1:
        v = ((w & 0x00F000F0) * 0x0104) & _SIGN_MAN16
    elif q == 2:
        v = (((w >> 8) & 0x000F000F) * 0x1040) & _SIGN_MAN16
    else:
        v = ((w >> 6) & _MAG16) | (w & _SIGN16)
    return v


@triton.jit
def _mx4_gemv_word_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK, GATED: tl.constexpr,
                          LIMIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          STAGES: tl.constexpr = 1):
    """_mx4_gemv_kernel's contract (variant "word", CUDA cores): tiles [BN, BK/32, 4] int32
    words, each nibble decoded from the word by _nib_f32, FP32 products with x_(8j+i)·2^63,
    group sums times 2^63·2^(e-127) as in _gemv_groups."""
    G: tl.constexpr = BK // 32
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    rg = tl.arange(0, G)
    rj = tl.arange(0, 4)                                    # word j of a group: inputs 8j..8j+7
    KW, KG = (K // 64) * 8, (K // 64) * 2                   # = K/8 words, K/32 groups a row
    w_off = e * N * KW + rn[:, None, None] * KW + rg[None, :, None] * 4 + rj[None, None, :]
    s_off = e * N * KG + rn[:, None] * KG + rg[None, :]     # [BN, G]
    a_off = arow * K + rg[:, None] * 32 + 8 * rj[None, :]   # [G, 4] input 8j of each word
    W1w, W3w = W1.to(tl.pointer_type(tl.int32)), W3.to(tl.pointer_type(tl.int32))
    acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros((BN, G), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        w1 = tl.load(W1w + w_off + k0 // 8, mask=n_ok[:, None, None], other=0)
        w3 = w1
        if GATED:
            w3 = tl.load(W3w + w_off + k0 // 8, mask=n_ok[:, None, None], other=0)
        t1 = tl.zeros((BN, G, 4), dtype=tl.float32)
        t3 = tl.zeros((BN, G, 4), dtype=tl.float32)
        for i in tl.static_range(8):
            a = (tl.load(A + a_off + k0 + i).to(tl.float32) * _TWO63)[None]      # [1, G, 4]
            t1 += _nib_f32(w1, i) * a
            if GATED:
                t3 += _nib_f32(w3, i) * a
        s1 = tl.load(S1 + s_off + k0 // 32, mask=n_ok[:, None], other=0)
        acc1 += tl.sum(t1, axis=2) * _TWO63 * _pow2(s1)
        if GATED:
            s3 = tl.load(S3 + s_off + k0 // 32, mask=n_ok[:, None], other=0)
            acc3 += tl.sum(t3, axis=2) * _TWO63 * _pow2(s3)
    _pair_store(OUT, RW, p, N, rn, n_ok, tl.sum(acc1, axis=1), tl.sum(acc3, axis=1), GATED,
                LIMIT)


@triton.jit
def _word4d_groups(Ww, S, w_off, s_off, k0, n_ok, shl, a):
    """One K tile of "word4d" -> FP32 [BN, G] group sums, scaled: words [BN, G, 4] at w_off,
    nibble i of each by (w << 28 - 4i) >> 6, masked (_nib_f32's 3 ops; shl [.., 8] = 28 - 4i),
    times a = x·2^63 [BN, G, 4, 8]; a group's 32 products summed, times 2^63·2^(e-127)."""
    w = tl.load(Ww + w_off + k0 // 8, mask=n_ok[:, None, None], other=0)
    d = (((w[:, :, :, None] << shl) >> 6) & _SIGN_EXP_MAN).to(tl.float32, bitcast=True)
    s = tl.load(S + s_off + k0 // 32, mask=n_ok[:, None], other=0)
    return tl.sum(tl.sum(d * a, axis=3), axis=2) * _TWO63 * _pow2(s)


@triton.jit
def _word4d_rows(A, arow, W1, S1, W3, S3, e, rn, n_ok, N, K, GATED: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """The "word" variant's math with its 8 nibbles on a 4th axis (variant "word4d") -> FP32
    [BN] row sums of expert e's rows rn · A[arow] (and W3's, GATED): a K tile's inputs are loaded
    once, [BN, G, 4, 8] (8 consecutive bf16 a word: 16-byte loads), where "word" loads them
    nibble by nibble as [G, 4] and moves each through shared memory to the weights' layout (PTX
    for sm_80: 8 bar.sync a K tile; here 4, two a weight tile, whose words change layout once).
    Per tile _word4d_groups for W1 (and W3)."""
    G: tl.constexpr = BK // 32
    rg = tl.arange(0, G)
    rj = tl.arange(0, 4)
    ri = tl.arange(0, 8)
    KW, KG = (K // 64) * 8, (K // 64) * 2
    w_off = e * N * KW + rn[:, None, None] * KW + rg[None, :, None] * 4 + rj[None, None, :]
    s_off = e * N * KG + rn[:, None] * KG + rg[None, :]
    a_off = (arow * K + rn[:, None, None, None] * 0 + rg[None, :, None, None] * 32
             + rj[None, None, :, None] * 8 + ri[None, None, None, :])       # [BN, G, 4, 8]
    shl = (28 - 4 * ri)[None, None, None, :]
    W1w, W3w = W1.to(tl.pointer_type(tl.int32)), W3.to(tl.pointer_type(tl.int32))
    acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros((BN, G), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(A + a_off + k0).to(tl.float32) * _TWO63                    # [BN, G, 4, 8]
        acc1 += _word4d_groups(W1w, S1, w_off, s_off, k0, n_ok, shl, a)
        if GATED:
            acc3 += _word4d_groups(W3w, S3, w_off, s_off, k0, n_ok, shl, a)
    return tl.sum(acc1, axis=1), tl.sum(acc3, axis=1)


@triton.jit
def _mx4_gemv_word4d_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK, GATED: tl.constexpr,
                            LIMIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            STAGES: tl.constexpr = 1):
    """_mx4_gemv_kernel's contract, variant "word4d" (_word4d_rows)."""
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    r1, r3 = _word4d_rows(A, arow, W1, S1, W3, S3, e, rn, n_ok, N, K, GATED, BN, BK, STAGES)
    _pair_store(OUT, RW, p, N, rn, n_ok, r1, r3, GATED, LIMIT)


@triton.jit
def _pair_lanes(w, q: tl.constexpr, F32: tl.constexpr):
    """_nib_pair(w, q) -> [..., 2] (low lane, high lane) as BF16 (F32: FP32 of the same values;
    the interpreter flushes BF16 subnormals when it widens them)."""
    v = _nib_pair(w, q)
    if F32:
        return tl.join((v << 16).to(tl.float32, bitcast=True),
                       (v & -65536).to(tl.float32, bitcast=True))
    return tl.join(v.to(tl.int16).to(tl.bfloat16, bitcast=True),
                   (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _pair_b(w, q: tl.constexpr, F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """int32 words [BN, BK/8] -> weights·2^-126 [BN, BK/4] of nibbles q, q + 4 of each word:
    column 2j + h = input 8j + q + 4h (h: lane; the two halves of one int32 side by side)."""
    return tl.reshape(_pair_lanes(w, q, F32), (BN, BK // 4))


@triton.jit
def _mma_groups(Ww, S, w_off, s_off, k0, n_ok, g_ok, a0, a1, a2, a3, F32: tl.constexpr,
                R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One K tile on the tensor cores -> FP32 [R, BN]: row r = group r's Σ w·x, scaled; four
    dots, one per nibble pair q (a_q [R, BK/4] in _pair_b's column order)."""
    w = tl.load(Ww + w_off + k0 // 8, mask=n_ok[:, None], other=0)                 # [BN, BK/8]
    part = tl.zeros((R, BN), dtype=tl.float32)
    part = dot_bf16(a0, tl.trans(_pair_b(w, 0, F32, BN, BK)), part, F32)
    part = dot_bf16(a1, tl.trans(_pair_b(w, 1, F32, BN, BK)), part, F32)
    part = dot_bf16(a2, tl.trans(_pair_b(w, 2, F32, BN, BK)), part, F32)
    part = dot_bf16(a3, tl.trans(_pair_b(w, 3, F32, BN, BK)), part, F32)        # ·2^-63
    s = tl.load(S + s_off + k0 // 32, mask=g_ok[:, None] & n_ok[None, :], other=0)  # [R, BN]
    return part * _TWO63 * _pow2(s)


@triton.jit
def _diag(xq, R: tl.constexpr, BK: tl.constexpr):
    """[BK/8, 2] values of one nibble pair (word j, lane h) -> BF16 [R, BK/4]: row r holds words
    4r..4r+3 (group r) at their columns 2j + h, zeros elsewhere (R >= BK/32 rows)."""
    xg = tl.reshape(xq, (R, 8)) if BK // 32 == R else tl.reshape(xq, (BK // 32, 8))
    rr = tl.arange(0, R)
    rg = tl.arange(0, BK // 32)
    a = tl.where((rr[:, None] == rg[None, :])[:, :, None], xg[None, :, :], 0.0)   # [R, G, 8]
    return tl.reshape(a, (R, BK // 4)).to(tl.bfloat16)


@triton.jit
def _mma_rows(x, R: tl.constexpr, BK: tl.constexpr):
    """x [BK] bf16 (natural order) -> per nibble pair q, x·2^63 on _pair_b's columns (inputs
    8j + q + 4h) of group r's row r, else 0: four BF16 [R, BK/4] (exact)."""
    x = tl.reshape(x.to(tl.float32) * _TWO63, (BK // 8, 2, 2, 2))   # [j, h, q // 2, q % 2]
    xe, xo = tl.split(x)                                            # q even, q odd
    x0, x2 = tl.split(xe)
    x1, x3 = tl.split(xo)
    return _diag(x0, R, BK), _diag(x1, R, BK), _diag(x2, R, BK), _diag(x3, R, BK)


@triton.jit
def _mx4_gemv_mma_kernel(A, IDX, RW, W1, S1, W3, S3, OUT, N, K, TOPK, GATED: tl.constexpr,
                         LIMIT: tl.constexpr, F32: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr,
                         STAGES: tl.constexpr = 1):
    """_mx4_gemv_kernel's contract on the tensor cores (variant "mma"): per K tile BF16 dots
    [R, BK] x [BK, BN] (four, one per nibble pair), R = max(16, BK/32) rows, row r holding
    x·2^63 on group r's 32 inputs only (zero elsewhere), so row r of the FP32 product is group
    r's sum (exact products); times 2^63·2^(e-127) per (group, row) into an FP32 [R, BN]
    accumulator, rows summed once at the end. Weights two per int32 (_nib_pair)."""
    G: tl.constexpr = BK // 32
    R: tl.constexpr = 16 if G < 16 else G
    p, e, arow, rn, n_ok = _pair_program(IDX, N, TOPK, GATED, BN)
    rw = tl.arange(0, BK // 8)
    rr = tl.arange(0, R)
    g_ok = rr < G
    KW, KG = (K // 64) * 8, (K // 64) * 2                   # = K/8 words, K/32 groups a row
    w_off = e * N * KW + rn[:, None] * KW + rw[None, :]     # [BN, BK/8]
    s_off = e * N * KG + rn[None, :] * KG + rr[:, None]     # [R, BN]
    a_off = arow * K + tl.arange(0, BK)
    W1w, W3w = W1.to(tl.pointer_type(tl.int32)), W3.to(tl.pointer_type(tl.int32))
    acc1 = tl.zeros((R, BN), dtype=tl.float32)
    acc3 = tl.zeros((R, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a0, a1, a2, a3 = _mma_rows(tl.load(A + a_off + k0), R, BK)
        acc1 += _mma_groups(W1w, S1, w_off, s_off, k0, n_ok, g_ok, a0, a1, a2, a3, F32, R, BN,
                            BK)
        if GATED:
            acc3 += _mma_groups(W3w, S3, w_off, s_off, k0, n_ok, g_ok, a0, a1, a2, a3, F32, R,
                                BN, BK)
    _pair_store(OUT, RW, p, N, rn, n_ok, tl.sum(acc1, axis=0), tl.sum(acc3, axis=0), GATED,
                LIMIT)


GEMV_KERNELS = dict(base=_mx4_gemv_kernel, prefetch=_mx4_gemv_prefetch_kernel,
                    word=_mx4_gemv_word_kernel, word4d=_mx4_gemv_word4d_kernel,
                    mma=_mx4_gemv_mma_kernel)
SUM_ROWS = dict(word4d=_word4d_rows)     # common._down_sum_kernel's ROWS by variant
