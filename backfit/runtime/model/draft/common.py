"""What both drafters share: the rows that draft a step and how a draft token is picked."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Draft", "DraftRows", "pick"]


class DraftRows(NamedTuple):
    """The sequences that draft this step: S of them, each after its last computed position."""

    seq_ids: tuple[int, ...]
    slots: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    last: tuple[int, ...]            # p: the last position in the cache (num_computed - 1)
    tokens: torch.Tensor             # [S] int64 on the device: x_{p+1}, the token after p
    k: int                           # drafts per sequence
    temperature: torch.Tensor | None  # [S] fp32 (0: greedy); None: every row greedy
    generator: torch.Generator | None  # the draws (seeded alike on every TP rank)


class Draft(NamedTuple):
    """A drafter's output for S sequences and k drafts each."""

    ids: torch.Tensor                # [S, k] int64: d_1 .. d_k
    probs: torch.Tensor | None       # [S, k, V] fp32: q each draft was drawn from (None: greedy)
    logits: torch.Tensor             # [S, k, V] fp32: the draft rows' logits (verify compares)
    confidence: torch.Tensor | None  # [S, k] fp32 raw logits (DSpark), None (MTP)


def pick(logits: torch.Tensor, rows: DraftRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [S, V] FP32 -> (draft ids [S], q [S, V] fp32 or None): the argmax on greedy rows,
    a draw from q = softmax(logits / T) on sampled ones (the exponential race)."""
    ids = logits.argmax(-1)
    if rows.temperature is None:
        return ids, None
    t = rows.temperature[:, None]
    q = torch.softmax(logits / t.clamp(min=1e-5), -1)
    ex = torch.empty_like(q).exponential_(generator=rows.generator).clamp_(min=1e-30)
    drawn = (q / ex).argmax(-1)
    return torch.where(rows.temperature > 0, drawn, ids), q
