"""mHC (manifold-constrained hyper-connections), dsv4-model.md 5.2.

The residual is hc_mult (4) parallel streams X [T, 4, d]. Around each sub-layer:
  hc_pre : X -> sub-layer input u [T, d], post gains [T, 4], mixing matrix M [T, 4, 4]
  hc_post: X' [T, k] = post_k · f + Σ_j M_jk · X[j]        (M_jk moves source j into destination k)
M is a row-softmax followed by Sinkhorn normalisation (hc_sinkhorn_iters - 1 more row/column
passes), so each destination ends as a convex combination of sources. All math in FP32.
The parameters (hc_{attn,ffn}_{fn,base,scale}, hc_head_*) are buffers of the owning block, so
they keep their checkpoint names; `add_hc_buffers` registers them.
With the "triton" kernel backend and CUDA bf16 streams, hc_pre / hc_post / hc_head run the fused
kernels of runtime.kernels.mhc.core (same signatures and results; 2 / 1 / 2 launches at decode);
otherwise the torch code below, which is the reference. At decode sizes the model (Block,
Transformer) instead takes runtime.kernels.mhc.decode through `decode_kernels` (hc_post fused
with the next hc_pre's partials, hc_pre fused with the following RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.runtime.kernels import kernel_path

__all__ = ["add_hc_buffers", "decode_kernels", "hc_head", "hc_post", "hc_pre"]


def add_hc_buffers(module: nn.Module, prefix: str, n_out: int, streams: int, dim: int) -> None:
    """Register `{prefix}_fn` [n_out, streams*dim], `{prefix}_base` [n_out], `{prefix}_scale`."""
    n_scale = 3 if n_out == (2 + streams) * streams else 1     # (pre, post, comb) or head only
    module.register_buffer(f"{prefix}_fn", torch.empty(n_out, streams * dim, dtype=torch.float32))
    module.register_buffer(f"{prefix}_base", torch.empty(n_out, dtype=torch.float32))
    module.register_buffer(f"{prefix}_scale", torch.empty(n_scale, dtype=torch.float32))


def _fused(X: torch.Tensor):
    """runtime.kernels.mhc.core when the triton backend is on and X is a CUDA bf16 tensor, else
    None."""
    if kernel_path(X) and X.dtype == torch.bfloat16:
        from backfit.runtime.kernels import mhc  # imports triton on first use
        return mhc.core
    return None


def decode_kernels(X: torch.Tensor):
    """runtime.kernels.mhc.decode for CUDA bf16 streams X [T, S, d] on the triton backend at
    decode sizes (T < mhc.MIX_TORCH_T) while mhc.decode.DECODE_FUSED is on, else None."""
    if not (kernel_path(X) and X.dtype == torch.bfloat16):
        return None
    from backfit.runtime.kernels import mhc  # imports triton on first use
    return mhc.decode if mhc.decode.DECODE_FUSED and X.shape[0] < mhc.MIX_TORCH_T else None


def _mix_logits(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """m = (fn @ flatten(X)) · rsqrt(mean(x²)+eps): X [T, S, d] -> [T, n_out] FP32."""
    x = X.flatten(1).float()                                       # [T, S*d], stream-major
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return (x @ fn.T) * r


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, hc_eps: float, norm_eps: float):
    """X [T, S, d] -> (u [T, d] in X.dtype, post [T, S] fp32, M [T, S, S] fp32)."""
    if (k := _fused(X)) is not None:
        return k.hc_pre(X, fn, scale, base, iters, hc_eps, norm_eps)
    S = X.shape[1]
    m = _mix_logits(X, fn, norm_eps)                               # [T, S + S + S*S]
    pre = torch.sigmoid(m[:, :S] * scale[0] + base[:S]) + hc_eps
    post = 2 * torch.sigmoid(m[:, S:2 * S] * scale[1] + base[S:2 * S])
    C = (m[:, 2 * S:] * scale[2] + base[2 * S:]).view(-1, S, S)    # C[t, j, k], index 2S + S*j + k
    M = torch.softmax(C, dim=-1) + hc_eps                          # row softmax (over k)
    M = M / (M.sum(dim=-2, keepdim=True) + hc_eps)                 # column normalise (over j)
    for _ in range(iters - 1):
        M = M / (M.sum(dim=-1, keepdim=True) + hc_eps)
        M = M / (M.sum(dim=-2, keepdim=True) + hc_eps)
    u = torch.einsum("ts,tsd->td", pre, X.float())                 # FP32 weighted stream sum
    return u.to(X.dtype), post, M


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """f [T, d] sub-layer output -> new streams [T, S, d]: post_k·f + Σ_j M_jk X_j (FP32 math)."""
    if (k := _fused(X)) is not None:
        return k.hc_post(f, X, post, M)
    mixed = torch.einsum("tjk,tjd->tkd", M, X.float())             # Mᵀ X per token
    return (post[:, :, None] * f.float()[:, None, :] + mixed).to(X.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final learned collapse S -> 1 (no Sinkhorn): X [T, S, d] -> h [T, d] in X.dtype."""
    if (k := _fused(X)) is not None:
        return k.hc_head(X, fn, scale, base, hc_eps, norm_eps)
    m = _mix_logits(X, fn, norm_eps)                               # [T, S]
    pre = torch.sigmoid(m * scale[0] + base) + hc_eps
    return torch.einsum("ts,tsd->td", pre, X.float()).to(X.dtype)
