"""One DeepSeek-V4 decoder layer (dsv4-model.md 5.3): mHC around attention and around the MoE.

The main tower (runtime.model.transformer) stacks them; the drafters (runtime.model.draft) build
on them too.
"""

from __future__ import annotations

import torch
from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.layers import RMSNorm
from backfit.runtime.model.attention import Attention
from backfit.runtime.model.hyper import add_hc_buffers, decode_kernels, hc_post, hc_pre
from backfit.runtime.model.moe import MoE

__all__ = ["Block"]


class Block(nn.Module):
    """One decoder layer: X -> hc(attn) -> hc(moe); X [T, hc_mult, d] in the activation dtype."""

    def __init__(self, cfg: ModelConfig, ratio: int, hashed: bool):
        super().__init__()
        self.cfg = cfg
        d, S = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, ratio)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, hashed)
        add_hc_buffers(self, "hc_attn", (2 + S) * S, S, d)        # 4 pre + 4 post + 16 comb
        add_hc_buffers(self, "hc_ffn", (2 + S) * S, S, d)

    def _hc(self, which: str, X: torch.Tensor):
        c = self.cfg
        return hc_pre(X, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_scale"),
                      getattr(self, f"hc_{which}_base"), c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, X: torch.Tensor, batch: ForwardBatch, cache, hc: dict | None = None
                ) -> torch.Tensor:
        """cache: this layer's cache bound to the batch (runtime/state.py interface).
        hc: Transformer.hidden's carry on the mhc_decode path: {"part": this layer's hc_attn
        partials or None, "u": its attention input made by the previous layer's last hc_post
        (mhc_decode.PRE_FOLD) or None, "next_fn": the fn whose partials the last hc_post
        computes or None, "next_pre": the next Block's pre_args("attn") or None}; "part" and
        "u" are replaced by those of the next layer."""
        if (k := decode_kernels(X)) is not None:
            return self._forward_decode(k, X, batch, cache, hc if hc is not None else {})
        post, M, pre = self.attn_in(X, batch.positions)
        o = self.attn.core(pre, batch, cache)
        return self.attn_out(X, o, post, M, batch.positions, batch.tokens)

    # A prefill / mixed batch's Block in two cache-free halves around attn.core (the pieces that
    # runtime/prefill_graphs.py captures: shapes from T alone)
    def attn_in(self, X: torch.Tensor, pos: torch.Tensor):
        """X [T, S, d] -> (post [T, S], M [T, S, S] of hc_attn, attn.pre's tensors)."""
        u, post, M = self._hc("attn", X)                          # u [T, d]
        return post, M, self.attn.pre(self.attn_norm(u), pos)

    def attn_kv(self, X: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The KV [T, D] this layer's attention would write for streams X [T, S, d] at pos
        (hc_pre, attn_norm, wkv, kv_norm, RoPE): a row's KV depends on that row alone, so a
        drafter fills its ring from rows it never runs whole."""
        u, _, _ = self._hc("attn", X)
        return self.attn.kv(self.attn_norm(u), pos)

    def attn_out(self, X: torch.Tensor, o: torch.Tensor, post: torch.Tensor, M: torch.Tensor,
                 pos: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """attn.core's o [T, Hl, D] -> wo_a/wo_b, hc_post, then the MoE sub-layer: X [T, S, d]."""
        X = hc_post(self.attn.post(o, pos, X.dtype), X, post, M)
        u, post, M = self._hc("ffn", X)
        return hc_post(self.ffn(self.ffn_norm(u), tokens), X, post, M)

    def _forward_decode(self, k, X: torch.Tensor, batch: ForwardBatch, cache, hc: dict):
        """kernels.mhc.decode: each hc_pre with its RMSNorm (1 launch on the critical path, its
        Sinkhorn beside it), each hc_post with the next hc_pre's partials (1 launch), the MoE's
        combine inside its hc_post (POST_COMBINE); same math as forward's torch path."""
        c = self.cfg

        def pre(which, X, norm, part, u):       # the Sinkhorn (post, M) on a side stream
            return k.hc_pre_async(X, getattr(self, f"hc_{which}_fn"),
                                  getattr(self, f"hc_{which}_scale"),
                                  getattr(self, f"hc_{which}_base"), c.hc_sinkhorn_iters, c.hc_eps,
                                  c.rms_norm_eps, norm=(norm.weight, norm.eps), part=part, u=u)
        u, post, M, wait = pre("attn", X, self.attn_norm, hc.get("part"), hc.get("u"))
        X, part, *u = k.hc_post(self.attn(u, batch, cache), X, post, M, next_fn=self.hc_ffn_fn,
                                wait=wait, pre=self.pre_args(k, "ffn"))    # u = ffn_norm(u)
        u, post, M, wait = pre("ffn", X, self.ffn_norm, part, u[0] if u else None)
        out = k.hc_post(self.ffn(u, batch.tokens, pairs=k.POST_COMBINE), X, post, M,
                        next_fn=hc.get("next_fn"), wait=wait, pre=hc.get("next_pre"))
        if hc.get("next_fn") is None:
            hc["part"] = hc["u"] = None
            return out
        out, hc["part"], *u = out
        hc["u"] = u[0] if u else None
        return out

    def pre_args(self, k, which: str):
        """mhc_decode's NextPre of this Block's hc_pre `which` (its RMSNorm included), for the
        hc_post before it to run (`which` in k.PRE_FOLD), else None."""
        if which not in k.PRE_FOLD:
            return None
        norm = self.attn_norm if which == "attn" else self.ffn_norm
        return k.NextPre(getattr(self, f"hc_{which}_scale"), getattr(self, f"hc_{which}_base"),
                         norm.weight, norm.eps, self.cfg.hc_eps, self.cfg.rms_norm_eps)
