"""Reference building blocks: numerics policy, RMSNorm, mHC (section 5.2) and MoE (section 5.5).

Shapes: S = tokens, N = hc_mult streams (4), H = hidden_size, E = routed experts, k = top-k.
Precision follows DeepSeek's reference `model.py`: the router, the mHC mixing and every
RMSNorm run in float32 whatever the activation dtype; activations are stored in `Numerics.act`
between ops (float32 for the exact reference, bfloat16 for the "noise floor" mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backfit.config import ModelConfig
from backfit.verify.qat import act_quant

__all__ = ["MoEStats", "Numerics", "hc_head", "hc_post", "hc_pre", "moe", "rms_norm", "route",
           "sinkhorn"]


@dataclass(frozen=True)
class Numerics:
    """Where values are rounded. act: storage dtype of activations; qat: section 4.5 fake quant."""

    act: torch.dtype = torch.float32
    qat: bool = False

    def lin(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """FP8/FP4 linear: x [..., K] @ w[N, K]^T -> [..., N] in `act` (FP32 accumulate).

        With QAT the input is FP8-quantized per 128 channels first, as the W8A8/W4A8 GEMM does.
        The dequantized weights are exact in bfloat16 (e4m3/e2m1 times a power of two).
        """
        if self.qat:
            x = act_quant(x)
        return F.linear(x.to(self.act), w.to(self.act))

    def lin_bf16(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Linear whose weight is BF16 on disk and which the reference runs unquantized."""
        return F.linear(x.to(self.act), w.to(self.act))


@dataclass
class MoEStats:
    """Counters for benchmarks/report_margins.py (how often clamps fire, how often bias matters)."""

    counts: dict = field(default_factory=dict)

    def add(self, key: str, hit: int, total: int) -> None:
        h, t = self.counts.get(key, (0, 0))
        self.counts[key] = (h + int(hit), t + int(total))

    def frac(self, key: str) -> float:
        h, t = self.counts.get(key, (0, 0))
        return h / t if t else float("nan")


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = w * x * rsqrt(mean(x^2) + eps) over the last dim, in float32; returns x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if w is not None:
        y = w.float() * y
    return y.to(x.dtype)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N(j), N(k)] logits -> near doubly-stochastic M (M_jk: source j -> destination k).

    Row softmax + eps, column normalise, then (iters - 1) x (row, column) normalisation; the
    last step is a column pass, so each destination column is (almost exactly) a convex mix.
    """
    m = torch.softmax(c, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def _mixes(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """X [S, N, H] -> (fn @ flat(X)) * rsqrt(mean(flat(X)^2) + eps): [S, rows(fn)], float32."""
    x = X.flatten(1).float()                                  # [S, N*H], stream-major
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)  # RMS over all N*H values
    return F.linear(x, fn.float()) * r


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [S, N, H] -> (u [S, H] in X.dtype, post [S, N] fp32, M [S, N, N] fp32)."""
    n = cfg.hc_mult
    m = _mixes(X, fn, cfg.rms_norm_eps)                                  # [S, (2+N)*N]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + cfg.hc_eps   # [S, N]
    post = 2 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])  # [S, N], in (0, 2)
    c = (m[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))  # [S, N(j), N(k)]
    M = sinkhorn(c, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    u = (pre.unsqueeze(-1) * X.float()).sum(dim=1)                      # FP32 sum, then stored
    return u.to(X.dtype), post, M


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """X'[k] = post_k * f + sum_j M_jk X[j]  (= post (x) f + M^T X); f [S, H], X [S, N, H]."""
    mixed = torch.einsum("sjk,sjh->skh", M, X.float())                   # [S, N, H]
    return (post.unsqueeze(-1) * f.float().unsqueeze(1) + mixed).to(X.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            cfg: ModelConfig) -> torch.Tensor:
    """Final learned collapse [S, N, H] -> [S, H]: sigmoid weights only (no Sinkhorn, no mean)."""
    m = _mixes(X, fn, cfg.rms_norm_eps)                                  # [S, N]
    pre = torch.sigmoid(m * scale.float()[0] + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * X.float()).sum(dim=1).to(X.dtype)


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            weight: torch.Tensor | None, limit: float, nx: Numerics,
            stats: MoEStats | None, kind: str) -> torch.Tensor:
    """x [T, H] -> [T, H] in nx.act; gate = w1 x, up = w3 x computed in FP32 after the GEMM."""
    g = nx.lin(x, w1).float()                                            # [T, I]
    u = nx.lin(x, w3).float()
    if stats is not None:
        stats.add(f"{kind}.gate", (g > limit).sum(), g.numel())
        stats.add(f"{kind}.up", (u.abs() > limit).sum(), u.numel())
    if limit > 0:                    # swiglu_limit: up to [-limit, limit], gate only from above
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:           # routing weight is applied BEFORE w2 (matters in BF16)
        h = weight * h
    return nx.lin(h.to(nx.act), w2)


def route(x: torch.Tensor, tokens: torch.Tensor, P, cfg: ModelConfig, hashed: bool,
          stats: MoEStats | None = None,
          is_image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: x [S, H] -> (experts [S, k] long, weights [S, k] float32).

    is_image [S] bool (a Vision-Exp prompt: every image-block position, dsv4-vision.md 11.1):
    those rows select top-k of s + bias_vl, in the hash layers too (their tid2eid row and the
    hash layers' own bias are not used); text rows route as without images. The bias never
    enters the weights.
    """
    k = cfg.num_experts_per_tok
    logits = F.linear(x.float(), P["ffn.gate.weight"].float())          # [S, E], router in FP32
    s = torch.sqrt(F.softplus(logits))                                   # sqrtsoftplus scores
    if hashed:                                                           # fixed token -> experts
        ids = tokens if is_image is None else torch.where(is_image, 0, tokens)
        idx = P["ffn.gate.tid2eid"][ids].long()                          # [S, k]
        if is_image is not None:
            vl = torch.topk(s + P["ffn.gate.bias_vl"].float(), k, dim=-1).indices
            idx = torch.where(is_image[:, None], vl, idx)
    else:                                                                # bias for selection only
        bias = P["ffn.gate.bias"].float()
        if is_image is not None:
            bias = torch.where(is_image[:, None], P["ffn.gate.bias_vl"].float(), bias)
        idx = torch.topk(s + bias, k, dim=-1).indices
        if stats is not None:
            plain = torch.topk(s, k, dim=-1).indices
            kept = (plain.unsqueeze(-1) == idx.unsqueeze(-2)).any(-1).sum(-1)   # [S] in both
            stats.add("bias_changed_selection", (kept < k).sum(), kept.numel())
            stats.add("bias_swapped_experts", (k - kept).sum(), kept.numel() * k)
    w = s.gather(1, idx)
    return idx, w / w.sum(dim=-1, keepdim=True) * cfg.routed_scaling_factor


def moe(x: torch.Tensor, tokens: torch.Tensor, P, cfg: ModelConfig, hashed: bool,
        nx: Numerics, stats: MoEStats | None = None,
        is_image: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, H] (after ffn_norm) -> routed + shared expert output [S, H] in nx.act.

    P: the layer's parameter source (P[name] -> float32 tensor, P.expert(e) -> (w1, w3, w2));
    is_image: see route().
    """
    limit = cfg.swiglu_limit
    idx, w = route(x, tokens, P, cfg, hashed, stats, is_image)          # [S, k] each

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)      # FP32 accumulator
    for e in torch.unique(idx).tolist():                   # one expert dequantized at a time
        rows, slot = torch.where(idx == e)
        w1, w3, w2 = P.expert(e)
        out = _swiglu(x[rows], w1, w3, w2, w[rows, slot, None], limit, nx, stats, "routed")
        y.index_add_(0, rows, out.float())
    sh = "ffn.shared_experts."
    y += _swiglu(x, P[sh + "w1.weight"], P[sh + "w3.weight"], P[sh + "w2.weight"], None, limit,
                 nx, stats, "shared").float()
    return y.to(nx.act)
