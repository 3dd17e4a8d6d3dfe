"""Around the decode attention kernel (kernels.attention.decode): the query's per-head RMS and
RoPE it applies first (q_rope), the output's inverse RoPE of its one-split epilogue (out_rope),
and the merge launches of split KV, plain and de-rotating.

Rotations follow rope_norm._rope_kernel bit for bit: inputs rounded to the act dtype, angles
p·f in FP64 rounded to FP32, every product rounded on its own (mul.rn: never an FMA) and the
result rounded again. The merge-and-rotate launch gets the same from enable_fp_fusion=False.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MERGE_PAIRS"]


@triton.jit
def _mul_rn(a, b, F32: tl.constexpr):
    """FP32 a·b rounded on its own, never contracted into an FMA (the rope kernel's products,
    which it gets from enable_fp_fusion=False); the interpreter never contracts."""
    if F32:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rope_q(QROW, q, h_ok, p, QF, eps, BH: tl.constexpr, D: tl.constexpr, QR: tl.constexpr,
            F32: tl.constexpr, DT: tl.constexpr):
    """q [BH, D] FP32 of wq_b's act-dtype output (D a power of 2), rows QROW [BH, 1] ->
    rope_norm.rope(q, pos, QF, QR, norm=(None, eps)) in registers: each head RMS-normalised and
    rounded to DT; its last QR lanes loaded again as [BH, QR] tiles, x and its pair partners
    (lane xor 1), normed, rounded, turned by p·f (angles FP64 -> FP32 on those QR lanes only)
    and rounded, then put in place through a [BH, D/QR, QR] view."""
    inv = tl.math.rsqrt(tl.sum(_mul_rn(q, q, F32), axis=1) / D + eps)[:, None]      # [BH, 1]
    qn = _mul_rn(q, inv, F32).to(DT).to(tl.float32)
    rr = tl.arange(0, QR)
    x = tl.load(QROW + (D - QR) + rr[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(QROW + (D - QR) + (rr ^ 1)[None, :], mask=h_ok[:, None], other=0.0)
    x = _mul_rn(x, inv, F32).to(DT).to(tl.float32)
    xp = _mul_rn(xp.to(tl.float32), inv, F32).to(DT).to(tl.float32)
    ang = p.to(tl.float64) * tl.load(QF + rr // 2)                                 # [QR]
    cos, sin = tl.cos(ang).to(tl.float32)[None, :], tl.sin(ang).to(tl.float32)[None, :]
    a, b = _mul_rn(x, cos, F32), _mul_rn(xp, sin, F32)     # even lane: x_d cos - x_d+1 sin
    r = tl.where((rr % 2 == 0)[None, :], a - b, b + a)     # odd: x_d-1 sin + x_d cos
    q3 = tl.reshape(qn, (BH, D // QR, QR))
    last = (tl.arange(0, D // QR) == D // QR - 1)[None, :, None]
    q3 = tl.where(last, r.to(DT).to(tl.float32)[:, None, :], q3)
    return tl.reshape(q3, (BH, D))


@triton.jit
def _merge_kernel(PO, PM, PL, SINK, O, H, D: tl.constexpr, DP: tl.constexpr,
                  SPLIT: tl.constexpr, SP: tl.constexpr):
    """(b, h): o = Σ_s e^(m_s-M) acc_s / (Σ_s e^(m_s-M) l_s + e^(sink-M)), M = max(m_s, sink)."""
    b, h = tl.program_id(0), tl.program_id(1)
    row = (b.to(tl.int64) * H + h) * SPLIT
    ss = tl.arange(0, SP)
    s_ok = ss < SPLIT
    dd = tl.arange(0, DP)
    m = tl.load(PM + row + ss, mask=s_ok, other=-1e30)
    l = tl.load(PL + row + ss, mask=s_ok, other=0.0)
    acc = tl.load(PO + (row + ss[:, None]) * D + dd[None, :],
                  mask=s_ok[:, None] & (dd < D)[None, :],
                  other=0.0)                                            # [SP, DP]
    sink = tl.load(SINK + h)
    M = tl.maximum(tl.max(m, axis=0), sink)
    a = tl.exp(m - M)
    o = tl.sum(acc * a[:, None], axis=0) / (tl.sum(l * a, axis=0) + tl.exp(sink - M))
    tl.store(O + (b.to(tl.int64) * H + h) * D + dd, o, mask=dd < D)


@triton.jit
def _merge_rope_kernel(PO, PM, PL, SINK, POS, F, O, H, D: tl.constexpr, R: tl.constexpr,
                       SPLIT: tl.constexpr, SP: tl.constexpr, DH: tl.constexpr):
    """_merge_kernel, then the inverse RoPE of _output (rope_norm._rope_kernel, SIGN -1) on the
    merged o, stored in O's dtype: o is merged as even / odd lanes so the rotation pairs (2i,
    2i+1) sit in registers; lanes before D - R are only rounded. Program (b, h, pair block):
    DH pairs of the D/2 (a [SP, DH] tile per lane parity: at 20+ splits, the CSA layer's, a
    whole head's [SP, D/2] spilled). Launched with FMA contraction off, as the rope kernel
    (every product and sum rounded as torch does)."""
    b, h = tl.program_id(0), tl.program_id(1)
    row = (b.to(tl.int64) * H + h) * SPLIT
    ss = tl.arange(0, SP)
    s_ok = ss < SPLIT
    i = tl.program_id(2) * DH + tl.arange(0, DH)                       # pair index
    m = tl.load(PM + row + ss, mask=s_ok, other=-1e30)
    l = tl.load(PL + row + ss, mask=s_ok, other=0.0)
    base = PO + (row + ss[:, None]) * D + 2 * i[None, :]
    acc_e = tl.load(base, mask=s_ok[:, None], other=0.0)                # [SP, DH] lanes 2i
    acc_o = tl.load(base + 1, mask=s_ok[:, None], other=0.0)            # lanes 2i + 1
    sink = tl.load(SINK + h)
    M = tl.maximum(tl.max(m, axis=0), sink)
    a = tl.exp(m - M)
    den = tl.sum(l * a, axis=0) + tl.exp(sink - M)
    oe = tl.sum(acc_e * a[:, None], axis=0) / den
    oo = tl.sum(acc_o * a[:, None], axis=0) / den
    oe = oe.to(O.dtype.element_ty).to(tl.float32)                       # rope's rounded inputs
    oo = oo.to(O.dtype.element_ty).to(tl.float32)
    rot = i >= (D - R) // 2                                             # pairs of the last R dims
    j = tl.where(rot, i - (D - R) // 2, 0)
    ang = tl.load(POS + b).to(tl.float64) * tl.load(F + j, mask=rot, other=0.0)
    cos = tl.where(rot, tl.cos(ang).to(tl.float32), 1.0)
    sin = tl.where(rot, -tl.sin(ang).to(tl.float32), 0.0)              # inverse: by -pos·f
    re = oe * cos - oo * sin
    ro = oe * sin + oo * cos
    out = O + (b.to(tl.int64) * H + h) * D + 2 * i
    tl.store(out, tl.where(rot, re, oe).to(O.dtype.element_ty))
    tl.store(out + 1, tl.where(rot, ro, oo).to(O.dtype.element_ty))


MERGE_PAIRS = 64      # _merge_rope_kernel: rotation pairs per program (D = 512: 4 programs a head)
