"""The chunked-prefill attention of kernels.attention.prefill with the head dimension in eight
column chunks (config CD=1): the same op, the same masks and numerics, another tiling.

Why: in _prefill_kernel the p·V dot [M, D] is far wider than tall, so Triton lays its warps
along the columns and the chained q·k dot takes the same layout: every warp then reads all of q
from shared memory for every key tile and computes every score of the tile (4× the q·k work
with 4 warps; the sm_80 / sm_90 TTGIR: mma warpsPerCTA [1, 4]). Here each program owns half of
the output columns (grid axis 2), and every dot is at most [M, D/8] wide: q·k as the sum of eight
[M, BN] dots over D/8-column chunks of q and of the key tile, p·V as four [M, D/8] accumulators.
With M >= D/8 (M = 64 at D 512) Triton lays the warps along the rows: each warp reads only its
16 rows of q and computes only its own scores. The scores are computed by both programs of a row
(the cost of half the accumulator), in the same order: each half's four chunks chained in order,
then the two half sums added (commutative, so both programs get the same bits).

Chunk c of the program of half h holds columns ((4h + c) mod 8)·CW .. +CW, CW = DP/8: chunks
0-3 are the program's own output columns, 4-7 the other half's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backfit.runtime.kernels.attention.tiles import (_block_rows, _entry_row, _finish, _fly_mask,
                                                     _fly_range, _rows_tile)


@triton.jit
def _cols(dc, c: tl.constexpr, CW: tl.constexpr, D: tl.constexpr):
    """Columns of chunk c of the program of half dc, and their mask (D padded to 8·CW)."""
    cc = ((dc * 4 + c) % 8) * CW + tl.arange(0, CW)
    return cc, cc < D


@triton.jit
def _load8(X, XS, rows, ok, dc, CW: tl.constexpr, D: tl.constexpr, INT8: tl.constexpr,
           F32: tl.constexpr, DT: tl.constexpr):
    """Rows `rows` (ok) of X [., D] (int8: scales XS [.]) as eight [BN, CW] chunks."""
    c0, o0 = _cols(dc, 0, CW, D)
    c1, o1 = _cols(dc, 1, CW, D)
    c2, o2 = _cols(dc, 2, CW, D)
    c3, o3 = _cols(dc, 3, CW, D)
    c4, o4 = _cols(dc, 4, CW, D)
    c5, o5 = _cols(dc, 5, CW, D)
    c6, o6 = _cols(dc, 6, CW, D)
    c7, o7 = _cols(dc, 7, CW, D)
    return (_rows_tile(X, XS, rows, ok, c0, o0, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c1, o1, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c2, o2, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c3, o3, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c4, o4, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c5, o5, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c6, o6, D, INT8, F32, DT),
            _rows_tile(X, XS, rows, ok, c7, o7, D, INT8, F32, DT))


@triton.jit
def _qk(q, k, s, EXACT: tl.constexpr):
    if EXACT:
        return tl.dot(q, tl.trans(k), s, input_precision="ieee")
    return tl.dot(q, tl.trans(k), s)


@triton.jit
def _pv(hi, lo, v, acc, alpha, F32: tl.constexpr, EXACT: tl.constexpr):
    """acc·alpha + p·v, p = hi + lo (EXACT: hi = p, FP32)."""
    acc = acc * alpha[:, None]
    if EXACT:
        return tl.dot(hi, v, acc, input_precision="ieee")
    return tl.dot(lo, v, tl.dot(hi, v, acc))


@triton.jit
def _step8(q0, q1, q2, q3, q4, q5, q6, q7, k0, k1, k2, k3, k4, k5, k6, k7, ok, m_i, l_i,
           a0, a1, a2, a3, scale, F32: tl.constexpr, EXACT: tl.constexpr, DT: tl.constexpr):
    """attention_prefill._step over one key tile given as chunks (see the module doc)."""
    z = tl.zeros(ok.shape, tl.float32)
    own = _qk(q3, k3, _qk(q2, k2, _qk(q1, k1, _qk(q0, k0, z, EXACT), EXACT), EXACT), EXACT)
    oth = _qk(q7, k7, _qk(q6, k6, _qk(q5, k5, _qk(q4, k4, z, EXACT), EXACT), EXACT), EXACT)
    s = tl.where(ok, (own + oth) * scale, float("-inf"))               # [M, BN]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if EXACT:
        hi, lo = p, p
    else:
        hi = p.to(DT)                          # p = hi + lo (~16 bits), both exact in FP32
        lo = (p - hi.to(tl.float32)).to(DT)
        if F32:                                # interpreter: BF16 dots are wrong there
            hi, lo = hi.to(tl.float32), lo.to(tl.float32)
    a0 = _pv(hi, lo, k0, a0, alpha, F32, EXACT)
    a1 = _pv(hi, lo, k1, a1, alpha, F32, EXACT)
    a2 = _pv(hi, lo, k2, a2, alpha, F32, EXACT)
    a3 = _pv(hi, lo, k3, a3, alpha, F32, EXACT)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _store(O, trow, row_ok, acc, a, den, dc, c: tl.constexpr, CW: tl.constexpr,
           D: tl.constexpr):
    """Output chunk c: acc · a / den (as _prefill_kernel rounds it)."""
    cc, c_ok = _cols(dc, c, CW, D)
    o = acc * a[:, None] / den[:, None]
    tl.store(O + trow[:, None] * D + cc[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & c_ok[None, :])


@triton.jit
def _prefill_cd_kernel(Q, KV, RING, RSC, SLOTS, POS, ENT, ESC, TABLES, SEL, SINK, SEQ, START,
                       BLOCKS, O, SPAN_LO, SPAN_HI, T, H, R, stride_tb, n_sel, scale,
                       W: tl.constexpr, RATIO: tl.constexpr, PB: tl.constexpr,
                       MODE: tl.constexpr, INT8: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                       F32: tl.constexpr, EXACT: tl.constexpr, DT: tl.constexpr,
                       SPAN: tl.constexpr):
    """Program (block i, head block hb, half dc): _prefill_kernel's rows, columns of half dc."""
    M: tl.constexpr = BQ * BH
    CW: tl.constexpr = DP // 8
    if MODE == 2:
        tl.static_assert(BQ == 1, "csa: one query per block (per-query selections)")
    i, hb, dc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, sqi, st, p0, p_last, p_r, hh, row_ok, trow = _block_rows(BLOCKS, SEQ, START, POS, T, H,
                                                                 i, hb, BQ, BH)
    q0, q1, q2, q3, q4, q5, q6, q7 = _load8(Q, Q, trow, row_ok, dc, CW, D, False, F32, DT)
    m_i = tl.full((M,), -1e30, tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    a0 = tl.zeros((M, CW), tl.float32)
    a1 = tl.zeros((M, CW), tl.float32)
    a2 = tl.zeros((M, CW), tl.float32)
    a3 = tl.zeros((M, CW), tl.float32)
    rn = tl.arange(0, BN)
    slot = tl.load(SLOTS + sqi).to(tl.int64)
    lo = tl.maximum(p0 - W + 1, 0)                                     # oldest key of the block
    k_end = tl.minimum(st, p_last + 1)                  # ring positions lo .. st-1 (one source)
    for k0 in range(lo, k_end, BN):
        kp = k0 + rn
        k_ok = kp < k_end
        x0, x1, x2, x3, x4, x5, x6, x7 = _load8(RING, RSC, slot * R + (kp % R), k_ok, dc, CW, D,
                                                INT8, F32, DT)
        ok = (kp[None, :] <= p_r[:, None]) & (kp[None, :] > p_r[:, None] - W) & k_ok[None, :]
        m_i, l_i, a0, a1, a2, a3 = _step8(q0, q1, q2, q3, q4, q5, q6, q7, x0, x1, x2, x3, x4,
                                          x5, x6, x7, ok, m_i, l_i, a0, a1, a2, a3, scale, F32,
                                          EXACT, DT)
    row0 = t0.to(tl.int64) - p0                                        # kv row of position 0
    kv_lo, kv_hi, s_lo, s_hi = _fly_range(SPAN_LO, SPAN_HI, trow, H, row_ok, p0, p_last, p_r, lo,
                                          st, SPAN)
    for k0 in range(kv_lo, kv_hi + 1, BN):                             # the chunk's own rows
        kp = k0 + rn
        k_ok = kp <= kv_hi
        x0, x1, x2, x3, x4, x5, x6, x7 = _load8(KV, KV, row0 + kp, k_ok, dc, CW, D, False, F32,
                                                DT)
        ok = _fly_mask(kp, k_ok, p_r, s_lo, s_hi, W, SPAN)
        m_i, l_i, a0, a1, a2, a3 = _step8(q0, q1, q2, q3, q4, q5, q6, q7, x0, x1, x2, x3, x4,
                                          x5, x6, x7, ok, m_i, l_i, a0, a1, a2, a3, scale, F32,
                                          EXACT, DT)
    if MODE == 1:                                                      # HCA: all valid entries
        n_r = (p_r + 1) // RATIO
        n_c = (p_last + 1) // RATIO
        for c0 in range(0, n_c, BN):
            c = c0 + rn
            c_ok = c < n_c
            e = _entry_row(TABLES, sqi, stride_tb, c, c_ok, PB)
            x0, x1, x2, x3, x4, x5, x6, x7 = _load8(ENT, ESC, e, c_ok, dc, CW, D, INT8, F32, DT)
            ok = (c[None, :] < n_r[:, None]) & c_ok[None, :]
            m_i, l_i, a0, a1, a2, a3 = _step8(q0, q1, q2, q3, q4, q5, q6, q7, x0, x1, x2, x3,
                                              x4, x5, x6, x7, ok, m_i, l_i, a0, a1, a2, a3,
                                              scale, F32, EXACT, DT)
    if MODE == 2:                                                      # CSA: t0's selection
        sel = SEL + t0.to(tl.int64) * n_sel
        n_live = tl.minimum(n_sel, (p0 + 1) // RATIO)                  # as _prefill_kernel
        for c0 in range(0, n_live, BN):
            j = tl.load(sel + c0 + rn, mask=c0 + rn < n_live, other=-1)
            c_ok = j >= 0
            e = _entry_row(TABLES, sqi, stride_tb, j, c_ok, PB)
            x0, x1, x2, x3, x4, x5, x6, x7 = _load8(ENT, ESC, e, c_ok, dc, CW, D, INT8, F32,
                                                    DT)
            ok = tl.broadcast_to(c_ok[None, :], (M, BN))
            m_i, l_i, a0, a1, a2, a3 = _step8(q0, q1, q2, q3, q4, q5, q6, q7, x0, x1, x2,
                                              x3, x4, x5, x6, x7, ok, m_i, l_i, a0, a1, a2,
                                              a3, scale, F32, EXACT, DT)
    a, den = _finish(SINK, hh, H, m_i, l_i)
    _store(O, trow, row_ok, a0, a, den, dc, 0, CW, D)
    _store(O, trow, row_ok, a1, a, den, dc, 1, CW, D)
    _store(O, trow, row_ok, a2, a, den, dc, 2, CW, D)
    _store(O, trow, row_ok, a3, a, den, dc, 3, CW, D)
