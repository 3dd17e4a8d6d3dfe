"""The split-KV merge of decode attention (kernels.attention.decode), in Triton.

Split s of query row (b, h) left m_s (its running max), l_s (Σ e^(s-m_s)) and acc_s (Σ e^(s-m_s)
k, [D] FP32) in PM / PL / PO at row (b·H + h)·SPLIT + s. The merge with the sink (only in the
denominator):
  o = Σ_s e^(m_s-M) acc_s / (Σ_s e^(m_s-M) l_s + e^(sink-M)),  M = max(max_s m_s, sink),
summed in split order, one lane a pair (2i, 2i+1): the same bits whatever the tile.
_merge_part adds the output path's inverse RoPE (rope_norm._rope_kernel, SIGN -1) on the last
R lanes of each head and stores the act dtype. Its launch (_merge_rope_kernel) compiles without
FMA contraction: every product and sum rounded as torch's rope does.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = []


@triton.jit
def _merged(PO, PM, PL, sink, row, i, ok, D: tl.constexpr, SPLIT: tl.constexpr):
    """Lanes [N]: row = (b·H + h)·SPLIT, pair i, sink of h -> (o[2i], o[2i+1]) FP32. Read
    through L2 (.cg): decode's own merge reads what other programs of its launch stored."""
    M = sink
    for s in tl.static_range(SPLIT):
        M = tl.maximum(M, tl.load(PM + row + s, mask=ok, other=-1e30, cache_modifier=".cg"))
    den = tl.zeros_like(M)
    oe = tl.zeros_like(M)
    oo = tl.zeros_like(M)
    for s in tl.static_range(SPLIT):
        a = tl.exp(tl.load(PM + row + s, mask=ok, other=-1e30, cache_modifier=".cg") - M)
        den += tl.load(PL + row + s, mask=ok, other=0.0, cache_modifier=".cg") * a
        base = PO + (row + s) * D + 2 * i
        oe += tl.load(base, mask=ok, other=0.0, cache_modifier=".cg") * a
        oo += tl.load(base + 1, mask=ok, other=0.0, cache_modifier=".cg") * a
    den += tl.exp(sink - M)
    return oe / den, oo / den


@triton.jit
def _merge_part(PO, PM, PL, SINK, POS, F, O, b, hb, part, H, D: tl.constexpr, R: tl.constexpr,
                SPLIT: tl.constexpr, BH: tl.constexpr, MP: tl.constexpr):
    """Pairs [part·MP, +MP) of head block hb (BH heads x D/2 pairs, head-major) of query b:
    merged, rounded to O's dtype (rope's inputs), de-rotated by -POS[b]·F on each head's last
    R/2 pairs (the rest only rounded), stored in O [B, H, D]."""
    e = part * MP + tl.arange(0, MP)
    h = hb * BH + e // (D // 2)
    i = e % (D // 2)
    ok = (e < BH * (D // 2)) & (h < H)
    b64 = b.to(tl.int64)
    row = (b64 * H + h) * SPLIT
    sink = tl.load(SINK + h, mask=ok, other=0.0)
    oe, oo = _merged(PO, PM, PL, sink, row, i, ok, D, SPLIT)
    oe = oe.to(O.dtype.element_ty).to(tl.float32)                       # rope's rounded inputs
    oo = oo.to(O.dtype.element_ty).to(tl.float32)
    rot = i >= (D - R) // 2                                             # pairs of the last R dims
    j = tl.where(rot, i - (D - R) // 2, 0)
    ang = tl.load(POS + b).to(tl.float64) * tl.load(F + j, mask=rot & ok, other=0.0)
    cos = tl.where(rot, tl.cos(ang).to(tl.float32), 1.0)
    sin = tl.where(rot, -tl.sin(ang).to(tl.float32), 0.0)              # inverse: by -pos·f
    re = oe * cos - oo * sin
    ro = oe * sin + oo * cos
    out = O + (b64 * H + h) * D + 2 * i
    tl.store(out, tl.where(rot, re, oe).to(O.dtype.element_ty), mask=ok)
    tl.store(out + 1, tl.where(rot, ro, oo).to(O.dtype.element_ty), mask=ok)


@triton.jit
def _merge_rope_kernel(PO, PM, PL, SINK, POS, F, O, H, D: tl.constexpr, R: tl.constexpr,
                       SPLIT: tl.constexpr, BH: tl.constexpr, MP: tl.constexpr):
    """Program (b, head block, part): _merge_part. Launched with FMA contraction off."""
    _merge_part(PO, PM, PL, SINK, POS, F, O, tl.program_id(0), tl.program_id(1),
                tl.program_id(2), H, D, R, SPLIT, BH, MP)


@triton.jit
def _merge_kernel(PO, PM, PL, SINK, O, H, D: tl.constexpr, SPLIT: tl.constexpr,
                  DP: tl.constexpr):
    """Program (b, h): the FP32 merge of one head (DP >= D/2 pair lanes), no rotation (the FP32
    act dtype's path)."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, DP)
    ok = i < D // 2
    sink = tl.load(SINK + h) + tl.zeros([DP], tl.float32)               # per lane, as row
    row = (b * H + h) * SPLIT + tl.zeros([DP], tl.int64)
    oe, oo = _merged(PO, PM, PL, sink, row, i, ok, D, SPLIT)
    out = O + (b * H + h) * D + 2 * i
    tl.store(out, oe, mask=ok)
    tl.store(out + 1, oo, mask=ok)
