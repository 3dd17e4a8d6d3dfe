"""Flash MTP block `mtp.0` (next-next-token draft), dsv4-model.md 5.8.

  Y = e_proj(enorm(embed[x_{t+1}])) (broadcast over streams) + h_proj(hnorm(X_t))   [T, 4, d]
  Y = Block(Y)       window-only attention (θ = rope_theta, no YaRN), scored router, own KV ring
  logits_{t+2} = head(norm(hc_head_mtp(Y)))          (embed and head shared with the main model)
X_t are the main model's streams before hc_head at the same positions as the batch. The caller
aligns next_tokens with the batch; the MTP ring is the cache's layer num_hidden_layers + stage,
keyed by the batch positions (bound with advance=False: no separate length check).
"""

from __future__ import annotations

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.layers import Linear, RMSNorm
from backfit.runtime.model.hyper import add_hc_buffers, hc_head
from backfit.runtime.model.block import Block
from backfit.runtime.state import DecodeState

__all__ = ["MTPBlock", "mtp_logits"]


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, ratio=0, hashed=False)
        d = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = (RMSNorm(d, cfg.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)     # replicated
        add_hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult, d)

    def draft(self, model, X: torch.Tensor, next_tokens: torch.Tensor, batch: ForwardBatch,
              state: DecodeState, stage: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """X [T, 4, d] main streams, next_tokens [T] -> (logits [T, vocab] FP32, Y [T, 4, d])."""
        e = self.e_proj(self.enorm(model.embed(next_tokens, X.dtype)))          # [T, d]
        Y = self.h_proj(self.hnorm(X)) + e[:, None, :]                         # hnorm per stream
        bound = state.bind(batch, advance=False)                                # rings only
        Y = self(Y, batch, bound.layer(model.cfg.num_hidden_layers + stage))
        c = self.cfg
        h = hc_head(Y, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.hc_eps, c.rms_norm_eps)
        return model.head(self.norm(h)), Y


@torch.no_grad()
def mtp_logits(model, batch: ForwardBatch, next_tokens: torch.Tensor,
               state: DecodeState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Main forward + MTP draft on the same batch -> (main logits [T, V], draft logits [T, V])."""
    state = state if state is not None else model.new_state()
    X = model.hidden(batch, state)
    draft, _ = model.mtp[0].draft(model, X, next_tokens, batch, state)
    return model.logits(X), draft
