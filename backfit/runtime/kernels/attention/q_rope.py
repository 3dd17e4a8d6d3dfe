"""The decode step's queries inside the kernels that read them: wq_b's raw output -> the
per-head RMS and RoPE of Attention._q_kv, i.e. rope_norm.rope(q, pos, inv_freq, r, norm=(None,
eps)), made by each decode attention program for its own heads (decode.py's q_rope), and the
CSA indexer's RoPE (Indexer.queries), made by each score program (indexer.py's q_rope; no
norm). The rope kernel's ops,
products rounded alone (mul.rn, never contracted into an FMA, as that launch runs without FMA
contraction); only the Σx² tree may differ (this tile's order), so a query lane may differ by one
ulp of q's dtype from the rope launch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_q_rope", "check_q_scale"]

_MUL_RN = tl.constexpr("mul.rn.f32 $0, $1, $2;")     # a product rounded alone: no FMA


@triton.jit
def _mul_rn(a, b, F32: tl.constexpr):
    """a·b rounded to FP32 by itself (the interpreter: no inline PTX, and it contracts nothing)."""
    if F32:
        return a * b
    return tl.inline_asm_elementwise(_MUL_RN, "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _rms_inv(A, eps, K: tl.constexpr):
    """rsqrt(mean(a²) + eps) of the K-vector at A (K a power of 2; FP32 math, this tile's
    tree)."""
    a = tl.load(A + tl.arange(0, K)).to(tl.float32)
    return tl.math.rsqrt(tl.sum(a * a, axis=0) / K + eps)


@triton.jit
def _q_rope(Q, row, dd, ok, p, QF, eps, D: tl.constexpr, QR: tl.constexpr, DT: tl.constexpr,
            F32: tl.constexpr, NORM: tl.constexpr = True, c=1.0):
    """Rows `row` [BH] of q [.., D] (a wq_b's output) -> FP32 [BH, DP] of DT values: rope_norm.rope(
    q, pos, QF, QR, norm=(None, eps))'s ops (NORM False: rope(q, pos, QF, QR)'s). NORM: x·rsqrt(
    mean(x²) + eps) rounded to DT; then the last QR lanes' pairs (2i, 2i+1) = (a, b) -> (a·cos -
    b·sin, a·sin + b·cos) at angle p·QF[i] (FP64, cos / sin rounded to FP32), each product
    rounded alone, rounded to DT. Each lane reads its pair partner (lane ^ 1) as a second load:
    no register shuffle. Σx² is this tile's tree (the rope kernel's tile differs): the inverse
    may differ in its last bit, so a query lane may differ by one DT ulp from the rope launch's
    (NORM False: bit for bit). c (NORM): q scaled by c in FP32 first (the scale-free q_norm's
    1/rms, _rms_inv)."""
    ptr = Q + row[:, None] * D
    x = tl.load(ptr + dd[None, :], mask=ok, other=0.0).to(tl.float32)         # [BH, DP]
    y = tl.load(ptr + (dd ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)   # the partner
    if NORM:
        x, y = x * c, y * c
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = (x * inv).to(DT).to(tl.float32)
        y = (y * inv).to(DT).to(tl.float32)
    rot = dd >= D - QR
    ang = p.to(tl.float64) * tl.load(QF + tl.where(rot, (dd - (D - QR)) // 2, 0), mask=rot,
                                     other=0.0)                                 # [DP] FP64
    cos = tl.cos(ang).to(tl.float32)[None, :]
    sin = tl.sin(ang).to(tl.float32)[None, :]
    xc = _mul_rn(x, cos, F32)                   # even lane: a·cos - b·sin (x = a, y = b)
    ys = _mul_rn(y, sin, F32)                   # odd lane:  a·sin + b·cos (y = a, x = b)
    r = tl.where((dd % 2 == 0)[None, :], xc - ys, ys + xc)
    return tl.where(rot[None, :], r, x).to(DT).to(tl.float32)


def check_q_rope(q_rope: tuple | None, D: int, decode: bool, who: str = "decode_attention",
                 eps: bool = True) -> tuple:
    """q_rope = (inv_freq FP64 [r/2], r[, eps]) -> the kernel's (QF, QR, q_eps); None -> no
    fold. eps False: the pair (inv_freq, r), q_eps 0."""
    if q_rope is None:
        return None, 0, 0.0
    f, r, q_eps = q_rope if eps else (*q_rope, 0.0)
    if not decode or f.dtype != torch.float64 or f.shape != (r // 2,) or r <= 0 or r > D \
            or r & (r - 1) or D % 2:
        raise ValueError(f"{who}: q_rope = (FP64 inv_freq [r/2], power-of-two r <= D"
                         f"{', eps' if eps else ''}), decode only, D even; got r={r}, D={D}")
    return f.contiguous(), r, float(q_eps)


def check_q_scale(q_scale: tuple | None, q_rope: tuple | None, B: int) -> tuple:
    """q_scale = (qa [B, KQ] (any row stride), eps) -> (QA, its row stride, KQ, eps); None ->
    (None, 0, 0, 0.0)."""
    if q_scale is None:
        return None, 0, 0, 0.0
    qa, eps = q_scale
    if q_rope is None or qa.dim() != 2 or qa.shape[0] != B or qa.stride(1) != 1 \
            or qa.shape[1] & (qa.shape[1] - 1):
        raise ValueError(f"decode_attention: q_scale = (qa [B={B}, K a power of 2] unit stride "
                         f"in K, eps) goes with q_rope; got {list(qa.shape)}")
    return qa, qa.stride(0), qa.shape[1], float(eps)
