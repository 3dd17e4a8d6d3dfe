"""MoE: sqrt-softplus router (bias for selection only, or token-id hash routing), routed experts
and one shared expert, SwiGLU with clamp. dsv4-model.md 5.5.

  s   = sqrt(softplus(x·Gᵀ))                        FP32
  idx = tid2eid[token] (hash layers) | topk(s + bias, k)
  w   = s[idx] / Σ s[idx] · routed_scaling_factor
  y   = Σ_k W2_e((w_k · h_e(x))) + W2_s(h_s(x)),   h(x) = silu(min(W1x, L)) · clamp(W3x, ±L)
Experts and the shared expert are split by intermediate dim (docs/FORMAT.md): every rank holds
1/tp of every expert, computes partial down-projections, and one all-reduce sums them.
With the "triton" kernel backend (runtime.kernels) the routed experts run as one fused launch
per projection over stacked weights (prepare_kernels), the router's GEMV and top-k one launch
for a decode batch (kernels.router; else the GEMV, then kernels.pointwise's route), the shared
expert's SwiGLU one launch, the shared gate|up one GEMV, and nothing syncs with the host. On CUDA the shared expert (3 launches, latency-bound at decode) runs on a
side stream while the router and the routed launches run (SHARED_STREAM, runtime/streams.py;
CUDA graphs capture it as a parallel branch); the combine waits for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.distributed import all_reduce, get_tp_info
from backfit.runtime.kernels import get_kernel_backend, kernel_path
from backfit.runtime.layers import ColumnParallelLinear, Linear, RowParallelLinear

__all__ = ["Expert", "Gate", "MoE", "ROUTER_FIRST", "SHARED_STREAM"]

SHARED_STREAM = True        # triton path on CUDA: the shared expert on a side stream
# With it: the router queued before the shared expert's launches, which wait for x only
# (streams.mark): the router, on the critical path, is launched first (else ~1 µs after the
# hc_pre before it, behind the shared gate|up; the H100 trace of the TP-4 slice, 2026-12-07)
ROUTER_FIRST = True


def _shared_on_side(expert: nn.Module, x: torch.Tensor, after=None):
    """expert(x) on the "moe" side stream (runtime/streams.py; after: a streams.mark to wait
    for instead of all the current stream queued) -> (output, event after it); the combine
    waits for the event, and `out` is read on the main stream only after that."""
    from backfit.runtime.streams import beside
    return beside(x.device, "moe", lambda: expert(x), after=after)


class Expert(nn.Module):
    """SwiGLU expert with clamp; w1 = gate, w3 = up, w2 = down (partial sum, no all-reduce)."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = ColumnParallelLinear(dim, inter)
        self.w3 = ColumnParallelLinear(dim, inter)
        self.w2 = RowParallelLinear(inter, dim, reduce=False)
        self.w13 = None                               # FusedProjection w1|w3 (shared expert)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, dim] -> [n, dim] partial (this rank's intermediate slice); weight [n] or None."""
        if weight is None and self.w13 is not None and x.dtype == torch.bfloat16 \
                and kernel_path(x):            # the shared expert
            from backfit.runtime.kernels.pointwise import swiglu
            return self.w2(swiglu(self.w13.joint(x), self.limit))  # gate|up in one launch
        g, u = self.w1(x).float(), self.w3(x).float()
        u = u.clamp(-self.limit, self.limit)          # clamp on up: both sides
        g = g.clamp(max=self.limit)                   # clamp on gate: upper only
        h = F.silu(g) * u
        if weight is not None:
            h = h * weight[:, None]                   # routing weight applied BEFORE w2
        return self.w2(h.to(x.dtype))


class Gate(Linear):
    """Router weight [E, dim] (replicated) plus `bias` [E] (scored) or `tid2eid` [vocab, k] (hash).

    Vision-Exp (cfg.vision): also `bias_vl` [E], the selection bias of image-block rows (token id
    >= vocab_size: all five block types), on every gate, hash layers included: such a row
    selects the top-k of s + bias_vl, never tid2eid (dsv4-vision.md 11.1). The hash layers'
    own `bias` is on disk there and loaded, but no forward reads it."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__(cfg.hidden_size, cfg.n_routed_experts)
        self.hashed, self.topk = hashed, cfg.num_experts_per_tok
        self.route_scale, self.vocab = cfg.routed_scaling_factor, cfg.vocab_size
        if cfg.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {cfg.scoring_func!r} not supported (sqrtsoftplus)")
        E = cfg.n_routed_experts
        if hashed:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, self.topk, dtype=torch.int64))
        if not hashed or cfg.vision is not None:
            self.register_buffer("bias", torch.empty(E, dtype=torch.float32))
        self.register_buffer("bias_vl", None if cfg.vision is None else
                             torch.empty(E, dtype=torch.float32))

    def route(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (expert ids [T, k] int64, weights [T, k] FP32)."""
        kw = dict(bias=None if self.hashed else self.bias,
                  tid2eid=self.tid2eid if self.hashed else None, tokens=tokens)
        if self.bias_vl is not None:
            kw.update(bias_vl=self.bias_vl, vocab=self.vocab)
        if kernel_path(x) and self._fused_router(x):                   # GEMV + route: 1 launch
            from backfit.runtime.kernels.router import router
            return router(x, self.weight, self.topk, self.route_scale, **kw)
        logits = self.forward_f32(x)                                  # [T, E] FP32
        if kernel_path(x):                                             # one launch after the GEMV
            from backfit.runtime.kernels.pointwise import route
            return route(logits, self.topk, self.route_scale, **kw)
        s = torch.sqrt(F.softplus(logits))                            # [T, E] FP32 router
        if self.bias_vl is None:
            if self.hashed:
                idx = self.tid2eid[tokens].long()                     # fixed experts, no top-k
            else:
                idx = (s + self.bias).topk(self.topk, dim=-1).indices  # bias only for selection
        else:                                                          # image rows: bias_vl
            img = (tokens >= self.vocab)[:, None]                     # [T, 1]
            text_bias = self.bias_vl if self.hashed else self.bias    # (hash: text rows unused)
            idx = (s + torch.where(img, self.bias_vl, text_bias)).topk(self.topk, dim=-1).indices
            if self.hashed:
                idx = torch.where(img, idx, self.tid2eid[tokens.masked_fill(img[:, 0], 0)].long())
        w = s.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True) * self.route_scale

    def _fused_router(self, x: torch.Tensor) -> bool:
        """kernels.router takes it (kernel path): a decode batch, bf16 x and a bf16 weight."""
        from backfit.runtime.kernels import router
        return router.FUSED and x.dtype == torch.bfloat16 \
            and self.weight.dtype == torch.bfloat16 and self.scheme in ("bf16", "copy") \
            and x.dim() == 2 and x.shape[0] <= router.FUSED_MAX_M


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        d, inter, lim = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        if cfg.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={cfg.n_shared_experts}: exactly 1 is supported")
        self.gate = Gate(cfg, hashed)
        self.experts = nn.ModuleList(Expert(d, inter, lim) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(d, inter, lim)
        self.stacked: tuple[torch.Tensor, ...] | None = None     # kernel layout; () = unsupported

    def prepare_kernels(self) -> bool:
        """Post-load step: stack the routed experts for runtime.kernels.moe.int8, int8_mx32 as
        [E, N, K] codes or mx4_e2m1 as [E, N, K/2] packed codes, each with [E, N, K/32]
        exponents (each expert's tensors become views: no extra memory once stacked). False if
        the experts are not all int8_mx32 or all mx4_e2m1 (the torch loop is used then)."""
        if self.stacked is None:
            from backfit.runtime.layers import FusedProjection
            sh = self.shared_experts                       # gate|up of the shared expert: one GEMV
            sh.w13 = FusedProjection.fuse([sh.w1, sh.w3])
            schemes = {m.scheme for ex in self.experts for m in (ex.w1, ex.w3, ex.w2)}
            if schemes not in ({"int8_mx32"}, {"mx4_e2m1"}):
                self.stacked = ()
                return False
            from backfit.runtime.kernels.moe import stack_experts
            self.stacked = stack_experts(self.experts)
        return bool(self.stacked)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, pairs: bool = False):
        """x [T, dim] (ffn_norm output), tokens [T] -> [T, dim] in x.dtype. pairs (the decode
        Block): at tp 1 on the triton path the routed pairs and the shared output come back
        unsummed (kernels.pointwise.PairSum) for kernels.mhc.decode.hc_post to sum; at tp > 1
        the all-reduced FP32 sum as a PairSum of one, which hc_post rounds to x.dtype."""
        if get_kernel_backend() == "triton" and x.dtype == torch.bfloat16 and self.prepare_kernels():
            from backfit.runtime.kernels.moe import fused_moe
            tp1 = get_tp_info().size == 1                             # FP32 for the all-reduce
            side = SHARED_STREAM and x.is_cuda
            start = None
            if side and ROUTER_FIRST:                    # the router launched first
                from backfit.runtime.streams import mark
                start = mark(x.device)
                idx, w = self.gate.route(x, tokens)
            if side:
                shared, ready = _shared_on_side(self.shared_experts, x, after=start)
            else:
                shared, ready = self.shared_experts(x), None
            if start is None:
                idx, w = self.gate.route(x, tokens)
            y = fused_moe(x, idx, w, *self.stacked, self.shared_experts.limit, shared=shared,
                          dtype=x.dtype if tp1 else torch.float32, shared_ready=ready,
                          pairs=pairs and tp1)
            if tp1:
                return y
            if pairs:                   # the FP32 sum's rounding to x.dtype inside hc_post
                from backfit.runtime.kernels.pointwise import combine_later
                return combine_later(all_reduce(y), 1, None, x.dtype)
            return all_reduce(y).to(x.dtype)
        idx, w = self.gate.route(x, tokens)
        y = self.shared_experts(x).float()                            # FP32 accumulator
        flat = idx.flatten()
        for e in torch.unique(flat).tolist():                         # only experts with tokens
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            y.index_add_(0, rows, self.experts[e](x[rows], w[rows, slot]).float())
        return all_reduce(y).to(x.dtype)                              # sum tp partial products
