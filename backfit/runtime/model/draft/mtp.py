"""Flash MTP block `mtp.0` (next-next-token draft), dsv4-model.md 5.8, chained for k > 1.

  Y_t = e_proj(enorm(embed[x_{t+1}])) (broadcast over streams) + h_proj(hnorm(X_t))   [T, 4, d]
  Y_t = Block(Y_t)     window-only attention (θ = rope_theta, no YaRN), scored router, own ring
  logits_{t+2} = head(norm(hc_head_mtp(Y_t)))        (embed and head shared with the main model)

X_t: the main tower's streams before hc_head at position t. The block's ring is the cache's layer
num_hidden_layers (ratio 0, W + K rows): row t's KV at position t.

MTPDrafter (the runner's):
  context  for every row of a forward, token x_t at position t: the block's KV of the row
           (X_{t-1}, x_t) into the ring at t - 1 (a row's KV depends on its own input alone, so
           only the KV is computed). One position behind the target: the last row's own MTP
           row needs the token sampled after it, and is the next step's (or the next draft's).
  draft    after position p with x_{p+1}: row 0 = (X_p, x_{p+1}) at position p; row j >= 1 =
           (Y_{j-1}, d_j) at position p + j, Y_{j-1} the block's own pre-hc_head output (vLLM's
           chaining). Its window sees the ring up to its own row.
"""

from __future__ import annotations

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch
from backfit.runtime.layers import Linear, RMSNorm
from backfit.runtime.model.block import Block
from backfit.runtime.model.draft.common import Draft, DraftRows, pick
from backfit.runtime.model.hyper import add_hc_buffers, hc_head
from backfit.runtime.state import DecodeState

__all__ = ["MTPBlock", "MTPDrafter", "mtp_logits"]


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, ratio=0, hashed=False)
        d = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = (RMSNorm(d, cfg.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)     # replicated
        add_hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult, d)

    def inputs(self, model, X: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """X [T, 4, d] streams, next_tokens [T] -> the block's input Y [T, 4, d]."""
        e = self.e_proj(self.enorm(model.embed(next_tokens, X.dtype)))          # [T, d]
        return self.h_proj(self.hnorm(X)) + e[:, None, :]                      # hnorm per stream

    def head_logits(self, model, Y: torch.Tensor) -> torch.Tensor:
        """The block's output streams Y [T, 4, d] -> FP32 logits [T, V] (shared head)."""
        c = self.cfg
        h = hc_head(Y, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.hc_eps,
                    c.rms_norm_eps)
        return model.head(self.norm(h))

    def draft(self, model, X: torch.Tensor, next_tokens: torch.Tensor, batch: ForwardBatch,
              state: DecodeState, stage: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """X [T, 4, d] main streams, next_tokens [T] -> (logits [T, vocab] FP32, Y [T, 4, d])
        over a DecodeState (the reference layout; the engine drafts through MTPDrafter)."""
        Y = self.inputs(model, X, next_tokens)
        bound = state.bind(batch, advance=False)                                # rings only
        Y = self(Y, batch, bound.layer(model.cfg.num_hidden_layers + stage))
        return self.head_logits(model, Y), Y


class MTPDrafter:
    """Flash MTP over the runner's PagedCache (see the module notes)."""

    def __init__(self, model, cache):
        self.model, self.block, self.cache = model, model.mtp[0], cache
        self.layer = model.cfg.num_hidden_layers                 # the block's cache layer
        self.needs_streams = True                                # the runner keeps X_p per slot

    def context(self, X_prev: torch.Tensor, taps, tokens: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor) -> None:
        """Rows of a forward, each token x_t at position t > 0 in its slot, X_prev [n, 4, d] the
        streams at t - 1: the block's KV of (X_{t-1}, x_t) into its ring at t - 1 (rows at
        t = 0 write the scratch slot). Device tensors only (taps: DSpark's, unused)."""
        Y = self.block.inputs(self.model, X_prev, tokens)
        kv = self.block.attn_kv(Y, (pos - 1).clamp(min=0))                    # [n, D]
        at = torch.where(pos > 0, slots.int(), self.cache.scratch_slot)
        self.cache.store_ring(self.layer, at, (pos - 1).clamp(min=0), kv)

    @torch.no_grad()
    def draft(self, rows: DraftRows, X_last: torch.Tensor) -> Draft:
        """X_last [S, 4, d]: each sequence's streams at p -> its k drafts."""
        ids, qs, ls, tokens, X = [], [], [], rows.tokens, X_last
        for j in range(rows.k):
            batch, bind = rows.batch(j)
            Y = self.block.inputs(self.model, X, tokens)
            Y = self.block(Y, batch, bind(self.cache).layer(self.layer))
            logits = self.block.head_logits(self.model, Y)
            d, q = pick(logits, rows, j)
            ids.append(d), qs.append(q), ls.append(logits)
            tokens, X = d, Y
        probs = None if qs[0] is None else torch.stack(qs, 1)
        return Draft(torch.stack(ids, 1), probs, torch.stack(ls, 1), None)


@torch.no_grad()
def mtp_logits(model, batch: ForwardBatch, next_tokens: torch.Tensor,
               state: DecodeState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Main forward + MTP draft on the same batch -> (main logits [T, V], draft logits [T, V])."""
    state = state if state is not None else model.new_state()
    X = model.hidden(batch, state)
    draft, _ = model.mtp[0].draft(model, X, next_tokens, batch, state)
    return model.logits(X), draft
