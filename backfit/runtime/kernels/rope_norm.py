"""RMSNorm and RoPE as one Triton launch each (the torch path spends ~6 and ~16 small kernels on
them, ~10 calls per layer), SM80-safe, no host sync.

  rms_norm(x, weight, eps)   y = x·rsqrt(mean(x²)+eps) [· weight], rows of the last dim, FP32
                             math, out in x.dtype: runtime.layers.RMSNorm, and (weight None) the
                             per-head query RMS of runtime.model.attention
  rope(x, pos, inv_freq, r)  interleaved (GPT-J) rotation of the last r dims of every vector of
                             x [n, ..., D] by pos[n]·f_i (inverse: by -pos[n]·f_i), the rest
                             copied: runtime.layers.Rotary. Angles and cos/sin in FP64, rounded to
                             FP32, then a·cos - b·sin and a·sin + b·cos with every product and sum
                             rounded as torch does (FMA contraction off), so the result is the
                             torch path's bit for bit. norm=(weight, eps): rms_norm first, in
                             the same launch; out_dtype: inputs rounded to it (x.to(dtype) first)
The sum of squares is a tree reduction (torch's order differs): RMSNorm agrees to FP32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rope"]


@triton.jit
def _rms_kernel(X, W, Y, N, stride_x, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of x [rows, N] (row stride stride_x) -> y [rows, N] contiguous."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(X + r * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * inv
    if HAS_W:
        y = y * tl.load(W + c, mask=ok, other=0.0)
    tl.store(Y + r * N + c, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(X, Y, POS, F, W, V, D, stride_xn, eps, SIGN: tl.constexpr, R: tl.constexpr,
                 BV: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
                 DP: tl.constexpr, HEAD: tl.constexpr = True):
    """Position n (program 0), vectors [vb·BV, +BV) of its V vectors of width D (program 1).
    NORM: each vector RMS-normalised first (· W), rounded to Y's dtype as _rms_kernel stores it;
    every input is rounded to Y's dtype before the rotation (FP32 x, bf16 y: torch's .to()).
    HEAD False (in place, Y = X): the unrotated D - R lanes are neither read nor written."""
    n, vb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    vv = vb * BV + tl.arange(0, BV)
    v_ok = vv < V
    row = (n * V + vv.to(tl.int64)) * D                                  # [BV] vector starts
    xrow = n * stride_xn + vv.to(tl.int64) * D                          # x rows may be strided
    inv = tl.full((BV,), 1.0, tl.float32)
    if NORM:
        full = tl.arange(0, DP)
        xs = tl.load(X + xrow[:, None] + full[None, :], mask=v_ok[:, None] & (full[None, :] < D),
                     other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)          # [BV]
    if HEAD:
        dd = tl.arange(0, BD)                                           # the unrotated head
        keep = v_ok[:, None] & (dd[None, :] < D - R)
        head = tl.load(X + xrow[:, None] + dd[None, :], mask=keep, other=0.0)
        if NORM:
            head = head.to(tl.float32) * inv[:, None]
            if HAS_W:
                head = head * tl.load(W + dd, mask=dd < D - R, other=0.0)[None, :]
        tl.store(Y + row[:, None] + dd[None, :], head.to(Y.dtype.element_ty), mask=keep)
    i = tl.arange(0, R // 2)
    ang = tl.load(POS + n).to(tl.float64) * tl.load(F + i)              # [R/2] FP64
    cos = tl.cos(ang).to(tl.float32)
    sin = tl.sin(ang).to(tl.float32) * SIGN
    # the rotated lanes as one contiguous [BV, R] load and store (pairs split / joined in
    # registers): two stride-2 loads and stores cost as much as the whole vector (2026-12-02)
    rr = tl.arange(0, R)
    ab = tl.load(X + xrow[:, None] + (D - R) + rr[None, :], mask=v_ok[:, None],
                 other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(ab, (BV, R // 2, 2)))                    # even, odd lanes
    if NORM:
        a, b = a * inv[:, None], b * inv[:, None]
        if HAS_W:
            a = a * tl.load(W + (D - R) + 2 * i)[None, :]
            b = b * tl.load(W + (D - R) + 2 * i + 1)[None, :]
    a = a.to(Y.dtype.element_ty).to(tl.float32)                         # the rounded inputs
    b = b.to(Y.dtype.element_ty).to(tl.float32)
    ra = a * cos[None, :] - b * sin[None, :]
    rb = a * sin[None, :] + b * cos[None, :]
    out = tl.reshape(tl.join(ra.to(Y.dtype.element_ty), rb.to(Y.dtype.element_ty)), (BV, R))
    tl.store(Y + row[:, None] + (D - R) + rr[None, :], out, mask=v_ok[:, None])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., N] (unit stride in the last dim), weight [N] FP32 or None -> [..., N] x.dtype."""
    N = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight is not None and (weight.shape != (N,) or weight.dtype != torch.float32):
        raise ValueError(f"rms_norm: weight must be FP32 [{N}], got {weight.dtype}{list(weight.shape)}")
    x2 = x.reshape(-1, N) if x.dim() != 2 else x
    if x2.dim() != 2 or (x2.shape[0] > 1 and x2.stride(1) != 1):
        x2 = x.contiguous().view(-1, N)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, N,
                                    x2.stride(0), eps, HAS_W=weight is not None,
                                    BLOCK=triton.next_power_of_2(N),
                                    num_warps=8 if N >= 2048 else 4)
    return y.view(x.shape)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
         inverse: bool = False, norm: tuple | None = None,
         out_dtype: torch.dtype | None = None, inplace: bool = False) -> torch.Tensor:
    """x [n, ..., D] with pos [n] int, inv_freq [rope_dim/2] FP64 -> a new tensor like x (dtype
    out_dtype, default x.dtype; inputs rounded to it first) with the last rope_dim dims of every
    D-vector rotated (runtime.layers.Rotary.forward). norm = (weight [D] FP32 or None, eps):
    rms_norm of every D-vector first, in the same launch (= rope(rms_norm(x, weight, eps))).
    inplace: x (contiguous; no norm, no out_dtype) rotated in place, only its last rope_dim
    lanes read and written; returns x (= rope(x), bit for bit, at R/D of the traffic)."""
    n, D = x.shape[0], x.shape[-1]
    if pos.shape != (n,) or rope_dim > D or rope_dim % 2 or rope_dim & (rope_dim - 1):
        raise ValueError(f"rope: x [n, ..., D>=r], pos [n], power-of-two r; got {list(x.shape)}, "
                         f"{list(pos.shape)}, r={rope_dim}")
    if inv_freq.dtype != torch.float64 or inv_freq.shape != (rope_dim // 2,):
        raise ValueError(f"rope: inv_freq must be FP64 [{rope_dim // 2}]")
    weight, eps = norm if norm is not None else (None, 0.0)
    if weight is not None and (weight.shape != (D,) or weight.dtype != torch.float32):
        raise ValueError(f"rope: norm weight must be FP32 [{D}], got {weight.dtype}"
                         f"{list(weight.shape)}")
    if inplace and (norm is not None or out_dtype not in (None, x.dtype)
                    or not x.is_contiguous()):
        raise ValueError("rope: inplace takes a contiguous x, no norm, no other out_dtype")
    if n and not x[0].is_contiguous():          # rows of x may be strided (fused projections)
        x = x.contiguous()
    y = x if inplace else torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    V = x.numel() // max(n * D, 1)
    if n and V:
        BV = min(16 if norm is None else 4, triton.next_power_of_2(V))
        _rope_kernel[(n, triton.cdiv(V, BV))](
            x, y, pos.contiguous(), inv_freq.contiguous(),
            weight.contiguous() if weight is not None else inv_freq, V, D,
            x.stride(0) if n > 1 else x[0].numel(), float(eps),
            SIGN=-1.0 if inverse else 1.0, R=rope_dim, BV=BV,
            BD=triton.next_power_of_2(max(D - rope_dim, 1)), NORM=norm is not None,
            HAS_W=weight is not None, DP=triton.next_power_of_2(D), HEAD=not inplace,
            num_warps=4, enable_fp_fusion=False)
    return y
