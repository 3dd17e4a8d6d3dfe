"""Flash MTP block `mtp.0` (next-next-token draft), dsv4-model.md 5.8, chained for k > 1.

  Y_t = e_proj(enorm(embed[x_{t+1}])) (broadcast over streams) + h_proj(hnorm(X_t))   [T, 4, d]
  Y_t = Block(Y_t)     window-only attention (θ = rope_theta, no YaRN), scored router, own ring
  logits_{t+2} = head(norm(hc_head_mtp(Y_t)))        (embed and head shared with the main model)

X_t: the main tower's streams before hc_head at position t. The block's ring is the cache's layer
num_hidden_layers (ratio 0, W + K rows): row t's KV at position t.

MTPDrafter (the runner's):
  context  over the rows of a forward at positions t with their next tokens x_{t+1} (a prompt's,
           or a verify step's drafts): only the KV of each row goes to the ring (a row's KV
           depends on its own input alone). A row whose next token is not known yet (the last
           of a prompt, the bonus row of a verify step) is written with a stand-in and
           rewritten by the next draft's first row, or by `rewrite` before the next chunk.
  draft    after position p with x_{p+1}: row 0 = (X_p, x_{p+1}) at position p (its KV replaces
           the stand-in); row j >= 1 = (Y_{j-1}, d_j) at position p + j, Y_{j-1} the block's own
           pre-hc_head output (vLLM's chaining). Its window sees the ring up to its own row.
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

    def __init__(self, model):
        self.model, self.block = model, model.mtp[0]
        self.layer = model.cfg.num_hidden_layers                 # the block's cache layer
        self.needs_streams = True                                # the runner keeps X_p per slot

    def context(self, X: torch.Tensor, taps, next_tokens: torch.Tensor, batch: ForwardBatch,
                bound) -> None:
        """The ring rows of a forward's rows: X [T, 4, d], next_tokens [T] (stand-ins where not
        known yet), at batch.positions, for every sequence of the bound batch (taps: unused)."""
        Y = self.block.inputs(self.model, X, next_tokens)
        kv = self.block.attn_kv(Y, batch.positions)                           # [T, D]
        bound.layer(self.layer).write_window_chunk(batch.positions, kv)

    def rewrite(self, X: torch.Tensor, next_tokens: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor, bound) -> None:
        """Ring rows at positions pos [n] of slots [n] from X [n, 4, d] and next_tokens [n]: a
        row written before its next token was known (or restored from another request's)."""
        kv = self.block.attn_kv(self.block.inputs(self.model, X, next_tokens), pos)
        bound.layer(self.layer).write_window_rows(slots, pos, kv)

    @torch.no_grad()
    def draft(self, rows: DraftRows, cache, X_last: torch.Tensor) -> Draft:
        """X_last [S, 4, d]: each sequence's streams at p -> its k drafts."""
        ids, qs, ls, tokens, X = [], [], [], rows.tokens, X_last
        for j in range(rows.k):
            batch = ForwardBatch.build([(s, [0], p + j) for s, p in zip(rows.seq_ids, rows.last)],
                                       X.device, rows.slots, rows.tables)
            Y = self.block.inputs(self.model, X, tokens)
            Y = self.block(Y, batch, cache.bind(batch).layer(self.layer))
            logits = self.block.head_logits(self.model, Y)
            d, q = pick(logits, rows)
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
