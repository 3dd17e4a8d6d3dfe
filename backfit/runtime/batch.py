"""ForwardBatch: every tensor one forward needs, passed as an argument (never a global).

Tokens of several sequences are concatenated: sequence i contributes `seq_lens[i]` new tokens
at positions starts[i] .. starts[i]+seq_lens[i]-1 (its first `starts[i]` tokens are already in
the decoding state). A full-sequence forward is a batch with start 0 and a fresh state; a decode
step is a batch with one token per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["ForwardBatch", "SeqSlice"]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a batch: rows [lo, hi) of the flattened tokens, first position start."""
    index: int
    seq_id: int
    lo: int
    hi: int
    start: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ForwardBatch:
    tokens: torch.Tensor          # [T] int64, sequences concatenated
    positions: torch.Tensor       # [T] int64 absolute positions
    seq_ids: tuple[int, ...]      # one id per sequence (keys of the decoding state)
    seq_lens: tuple[int, ...]     # new tokens per sequence, sum = T
    starts: tuple[int, ...]       # tokens already cached per sequence = position of its first token

    def __post_init__(self):
        T = int(self.tokens.shape[0])
        if not (len(self.seq_ids) == len(self.seq_lens) == len(self.starts)):
            raise ValueError("seq_ids, seq_lens and starts must have one entry per sequence")
        if sum(self.seq_lens) != T or self.positions.shape != self.tokens.shape:
            raise ValueError(f"batch of {T} tokens does not match seq_lens {self.seq_lens}")
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"duplicate sequence ids {self.seq_ids}")
        if any(n < 1 for n in self.seq_lens):
            raise ValueError("every sequence needs at least one new token")

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, Sequence[int] | torch.Tensor, int]],
              device: str | torch.device = "cpu") -> "ForwardBatch":
        """From [(seq_id, new token ids, start position), ...]."""
        toks, pos = [], []
        for _, t, start in seqs:
            t = torch.as_tensor(t, dtype=torch.int64).reshape(-1)
            toks.append(t)
            pos.append(torch.arange(start, start + t.numel(), dtype=torch.int64))
        return cls(torch.cat(toks).to(device), torch.cat(pos).to(device),
                   tuple(int(s[0]) for s in seqs), tuple(int(t.numel()) for t in toks),
                   tuple(int(s[2]) for s in seqs))

    @classmethod
    def single(cls, tokens: Sequence[int] | torch.Tensor, start: int = 0, seq_id: int = 0,
               device: str | torch.device = "cpu") -> "ForwardBatch":
        return cls.build([(seq_id, tokens, start)], device)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def slices(self) -> Iterator[SeqSlice]:
        lo = 0
        for i, (sid, n, start) in enumerate(zip(self.seq_ids, self.seq_lens, self.starts)):
            yield SeqSlice(i, sid, lo, lo + n, start)
            lo += n

    def last_rows(self) -> torch.Tensor:
        """[num_seqs] index of each sequence's last token in the flattened batch."""
        ends = torch.tensor(self.seq_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.tokens.device)
