"""The CSA indexer's query RoPE inside its score kernel (indexer.py's q_rope): the indexer wq_b's
raw output rotated as Indexer.queries' rope launch would, rope_norm.rope(qI, pos, inv_freq, r),
bit for bit, by each score program for its own query (one launch fewer on the decode step's
indexer chain). The rope kernel's ops: angles p·f in FP64 rounded to FP32, each product rounded
alone (mul.rn, never contracted into an FMA, as that launch runs without FMA contraction), the
result rounded to the act dtype. (The main query's norm + RoPE inside decode attention lost
twice, +7.8 and +122 µs a batch-1 slice step: docs/KERNELS.md "Attention".)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_q_rope"]

_MUL_RN = tl.constexpr("mul.rn.f32 $0, $1, $2;")     # a product rounded alone: no FMA


@triton.jit
def _mul_rn(a, b, F32: tl.constexpr):
    """a·b rounded to FP32 by itself (the interpreter: no inline PTX, and it contracts nothing)."""
    if F32:
        return a * b
    return tl.inline_asm_elementwise(_MUL_RN, "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _q_rope(Q, row, dd, ok, p, QF, D: tl.constexpr, QR: tl.constexpr, DT: tl.constexpr,
            F32: tl.constexpr):
    """Rows `row` [BH] of q [.., D] -> FP32 [BH, D] of DT values = rope_norm.rope(q, pos, QF, QR)
    of them: the last QR lanes' pairs (2i, 2i+1) = (a, b) -> (a·cos - b·sin, a·sin + b·cos) at
    angle p·QF[i], rounded to DT; the other lanes as loaded. Each lane reads its pair partner
    (lane ^ 1) as a second load: no register shuffle."""
    ptr = Q + row[:, None] * D
    x = tl.load(ptr + dd[None, :], mask=ok, other=0.0).to(tl.float32)         # [BH, D]
    y = tl.load(ptr + (dd ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)   # the partner
    rot = dd >= D - QR
    ang = p.to(tl.float64) * tl.load(QF + tl.where(rot, (dd - (D - QR)) // 2, 0), mask=rot,
                                     other=0.0)                                 # [D] FP64
    cos = tl.cos(ang).to(tl.float32)[None, :]
    sin = tl.sin(ang).to(tl.float32)[None, :]
    xc = _mul_rn(x, cos, F32)                   # even lane: a·cos - b·sin (x = a, y = b)
    ys = _mul_rn(y, sin, F32)                   # odd lane:  a·sin + b·cos (y = a, x = b)
    r = tl.where((dd % 2 == 0)[None, :], xc - ys, ys + xc)
    return tl.where(rot[None, :], r.to(DT).to(tl.float32), x)


def check_q_rope(q_rope: tuple | None, D: int, decode: bool) -> tuple:
    """q_rope = (inv_freq FP64 [r/2], r) -> the kernel's (QF, QR); None -> (None, 0)."""
    if q_rope is None:
        return None, 0
    f, r = q_rope
    if not decode or f.dtype != torch.float64 or f.shape != (r // 2,) or r <= 0 or r > D \
            or r & (r - 1) or D % 2:
        raise ValueError(f"indexer_scores: q_rope = (FP64 inv_freq [r/2], power-of-two r <= D), "
                         f"decode only, D even; got r={r}, D={D}")
    return f.contiguous(), r
