"""The key and row tiles of the two chunked-prefill attention kernels (kernels.attention.prefill's
plain one and kernels.attention.prefill_cd's column-chunked one): loads of ring rows, in-flight kv
rows and compressed entries through the block tables (int8 pools dequantized as _Store.get), a
program's query-block rows, the in-flight key range and mask (with Vision-Exp image spans), and
the sink's share of the softmax denominator.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list[str] = []


@triton.jit
def _keys(x, INT8: tl.constexpr, s, F32: tl.constexpr, DT: tl.constexpr):
    """Loaded vectors [BN, DP] -> the dot dtype: int8 dequantized with s [BN] (= _Store.get)."""
    if INT8:
        x = (x.to(tl.float32) * s[:, None]).to(DT)
    if F32:                                    # interpreter: BF16 dots are wrong there
        x = x.to(tl.float32)
    return x


@triton.jit
def _rows_tile(X, XS, rows, ok, dd, d_ok, D: tl.constexpr, INT8: tl.constexpr,
               F32: tl.constexpr, DT: tl.constexpr):
    """Rows `rows` (ok) of X [., D], columns dd (d_ok) -> [len(rows), len(dd)] in the dot dtype
    (int8: scales XS [.])."""
    x = tl.load(X + rows[:, None] * D + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0)
    sc = 0.0
    if INT8:
        sc = tl.load(XS + rows, mask=ok, other=0.0)
    return _keys(x, INT8, sc, F32, DT)


@triton.jit
def _ring_tile(RING, RSC, slot, R, kp, k_ok, dd, d_ok, D: tl.constexpr, INT8: tl.constexpr,
               F32: tl.constexpr, DT: tl.constexpr):
    """Ring rows of positions kp (k_ok) of one slot."""
    return _rows_tile(RING, RSC, slot * R + (kp % R), k_ok, dd, d_ok, D, INT8, F32, DT)


@triton.jit
def _kv_tile(KV, kv_row, k_ok, dd, d_ok, D: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    """The chunk's own kv rows (in flight, act dtype)."""
    return _rows_tile(KV, KV, kv_row, k_ok, dd, d_ok, D, False, F32, DT)


@triton.jit
def _entry_row(TABLES, sqi, stride_tb, j, c_ok, PB: tl.constexpr):
    """Pool row of compressed entries j (c_ok) of sequence sqi: block TABLES[sqi, j // PB],
    row j % PB."""
    j = tl.where(c_ok, j, 0)
    blk = tl.load(TABLES + sqi * stride_tb + j // PB, mask=c_ok, other=0).to(tl.int64)
    return blk * PB + j % PB


@triton.jit
def _entry_tile(ENT, ESC, TABLES, sqi, stride_tb, j, c_ok, dd, d_ok, PB: tl.constexpr,
                D: tl.constexpr, INT8: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    """Compressed entries j (c_ok) of sequence sqi."""
    return _rows_tile(ENT, ESC, _entry_row(TABLES, sqi, stride_tb, j, c_ok, PB), c_ok, dd, d_ok,
                      D, INT8, F32, DT)


@triton.jit
def _block_rows(BLOCKS, SEQ, START, POS, T, H, i, hb, BQ: tl.constexpr, BH: tl.constexpr):
    """Rows r = (query t0 + r // BH, head hb·BH + r % BH) of block i -> t0 (>= 0), sqi (its
    sequence, int64), st (its chunk's start), p0 / p_last (positions of the first / last query;
    -1 / -2 for a spare program), p_r [M] (each row's position), hh [M] (heads), row_ok [M],
    trow [M] (row of q / o [T·H], int64)."""
    M: tl.constexpr = BQ * BH
    t0 = tl.load(BLOCKS + i)                                           # -1: spare program
    live = t0 >= 0
    qq = tl.arange(0, BQ)                                              # rows of one chunk
    inq = (t0 + qq < T) & (t0 + qq * 0 >= 0)
    t0 = tl.maximum(t0, 0)
    sq0 = tl.load(SEQ + t0)
    st = tl.load(START + t0)                                           # the chunk's start
    p0 = tl.where(live, tl.load(POS + t0), -1)                        # spare: empty loops
    tq = t0 + qq
    inq = inq & (tl.load(SEQ + tq, mask=inq, other=-1) == sq0)
    inq = inq & (tl.load(START + tq, mask=inq, other=-1) == st)
    p_last = p0 + tl.sum(inq.to(tl.int32), axis=0) - 1                 # p0 - 1 if not live
    r = tl.arange(0, M)
    qi = r // BH
    hh = hb * BH + r % BH
    row_ok = (qi < p_last - p0 + 1) & (hh < H)                        # [M]
    trow = (t0 + qi).to(tl.int64) * H + hh                             # row of q/o [T·H]
    return t0, sq0.to(tl.int64), st, p0, p_last, p0 + qi, hh, row_ok, trow


@triton.jit
def _fly_range(SPAN_LO, SPAN_HI, trow, H, row_ok, p0, p_last, p_r, lo, st, SPAN: tl.constexpr):
    """The block's in-flight key positions kv_lo .. kv_hi, and each row's image span (s_lo,
    s_hi) [M]. Without SPAN: max(lo, st) .. p_last (the causal window's part in the chunk).
    With SPAN (image prompts): widened to every row's span, which lies in the chunk; a spare
    row's span is the empty (p_last, p0)."""
    kv_lo = tl.maximum(lo, st)
    kv_hi = p_last
    s_lo = p_r
    s_hi = p_r
    if SPAN:
        tok = trow // H                                                # the row's token
        s_lo = tl.where(row_ok, tl.load(SPAN_LO + tok, mask=row_ok, other=0), p_last)
        s_hi = tl.where(row_ok, tl.load(SPAN_HI + tok, mask=row_ok, other=0), p0)
        kv_lo = tl.maximum(tl.minimum(lo, tl.min(s_lo, axis=0)), st)
        kv_hi = tl.maximum(p_last, tl.max(s_hi, axis=0))
    return kv_lo, kv_hi, s_lo, s_hi


@triton.jit
def _fly_mask(kp, k_ok, p_r, s_lo, s_hi, W: tl.constexpr, SPAN: tl.constexpr):
    """[M, BN]: in-flight key positions kp (k_ok) each row sees: its causal window band
    (p-W < kp <= p) and, with SPAN, its image span s_lo .. s_hi."""
    ok = (kp[None, :] <= p_r[:, None]) & (kp[None, :] > p_r[:, None] - W)
    if SPAN:
        ok = ok | ((kp[None, :] >= s_lo[:, None]) & (kp[None, :] <= s_hi[:, None]))
    return ok & k_ok[None, :]


@triton.jit
def _finish(SINK, hh, H, m_i, l_i):
    """The sink in the denominator: o = acc · a / den -> (a, den) [M]."""
    sink = tl.load(SINK + hh, mask=hh < H, other=0.0)
    Mx = tl.maximum(m_i, sink)
    a = tl.exp(m_i - Mx)
    return a, l_i * a + tl.exp(sink - Mx)
