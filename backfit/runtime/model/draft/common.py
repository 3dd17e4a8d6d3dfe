"""What both drafters share: the rows that draft a step and how a draft token is picked."""

from __future__ import annotations

from typing import NamedTuple

import torch

from backfit.runtime.kernels import kernel_path

__all__ = ["Draft", "DraftRows", "PICK_KERNEL", "pick"]

# A pick with temperatures (every step of a CUDA graph: one graph serves greedy and sampled rows)
# on the kernel path: True = kernels.pick (three launches split over the vocabulary); False =
# torch's softmax and two argmax (one thread block a row: ~110 µs a pick at V = 129,280, H100).
PICK_KERNEL = True


class DraftRows(NamedTuple):
    """The S sequences that draft a step, each after its last computed position p, as device
    tensors (a CUDA graph captures the draft over them); `host` (seq ids, slots, tables, p as
    host tuples) lets the eager torch path bind the pools as it binds any batch."""

    tokens: torch.Tensor             # [S] int64: x_{p+1}, the token after p
    last: torch.Tensor               # [S] int64: p
    slots: torch.Tensor              # [S] int32
    tables: torch.Tensor             # [S, nblk] int32 block tables (padded)
    k: int                           # drafts per sequence
    temperature: torch.Tensor | None  # [S] fp32 (0: greedy); None: every row greedy
    noise: torch.Tensor | None       # [k, S, V] Exp(1) draws of the sampled drafts (drawn on
    #                                  rank 0's seed alike on every rank), None when all greedy
    host: tuple | None = None        # (seq_ids, slots, tables, last) tuples, eager only

    def batch(self, offset: int, rows: int = 1):
        """(ForwardBatch, bind(cache)) of `rows` tokens per sequence at positions p + offset ..
        (tokens zero: the drafters feed their inputs as streams)."""
        from backfit.runtime.batch import ForwardBatch
        S, dev = self.tokens.shape[0], self.tokens.device
        if self.host is not None:
            ids, slots, tables, last = self.host
            b = ForwardBatch.build([(s, [0] * rows, p + offset) for s, p in zip(ids, last)], dev,
                                   slots, tables)
            return b, lambda cache: cache.bind(b)
        pos = (self.last[:, None] + offset + torch.arange(rows, device=dev)[None]).flatten()
        b = ForwardBatch(torch.zeros_like(pos), pos, tuple(range(S)), (rows,) * S, (0,) * S)
        return b, lambda cache: cache.bind_device(self.slots, self.tables)


class Draft(NamedTuple):
    """A drafter's output for S sequences and k drafts each."""

    ids: torch.Tensor                # [S, k] int64: d_1 .. d_k
    probs: torch.Tensor | None       # [S, k, V] fp32: q each draft was drawn from (None: greedy)
    logits: torch.Tensor             # [S, k, V] fp32: the draft rows' logits (verify compares)
    confidence: torch.Tensor | None  # [S, k] fp32 raw logits (DSpark), None (MTP)


def pick(logits: torch.Tensor, rows: DraftRows, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft j's logits [S, V] FP32 -> (ids [S], q [S, V] fp32 or None): the argmax on greedy
    rows, on sampled ones a draw from q = softmax(logits / T) (the exponential race over
    rows.noise[j]). On the kernel path (PICK_KERNEL) kernels.pick's three split launches: the
    same greedy ids, q to FP32 rounding of this softmax, the draw exactly from that q."""
    if rows.temperature is None:
        return logits.argmax(-1), None
    if PICK_KERNEL and kernel_path(logits) and rows.noise is not None:
        from backfit.runtime.kernels.pick import pick_tokens
        return pick_tokens(logits.contiguous(), rows.temperature.float(), rows.noise[j])
    ids = logits.argmax(-1)
    q = torch.softmax(logits / rows.temperature[:, None].clamp(min=1e-5), -1)
    drawn = (q / rows.noise[j]).argmax(-1)
    return torch.where(rows.temperature > 0, drawn, ids), q
