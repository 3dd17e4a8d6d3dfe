"""ForwardBatch: every tensor one forward needs, passed as an argument (never a global).

Tokens of several sequences are concatenated: sequence i contributes `seq_lens[i]` new tokens
at positions starts[i] .. starts[i]+seq_lens[i]-1 (its first `starts[i]` tokens are already in
the decoding state). A full-sequence forward is a batch with start 0 and a fresh state; a decode
step is a batch with one token per sequence.

With the engine's paged cache (runtime/cache/paged.py) each sequence also carries its slot (the
fixed-size state: window ring, compressor rows) and its block table (block i holds the
compressed entries of positions i*block_size ...); the plain DecodeState ignores both.

A batch with Vision-Exp images carries BatchImages (built by runtime/images.py): the LM-input
rows of its image-block positions and, per token, the in-image span its window also sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Iterator, Sequence

import torch

__all__ = ["BatchImages", "ForwardBatch", "SeqSlice", "to_device", "fill_placeholders_"]


def to_device(data, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Host data (list, tuple, CPU tensor) -> a tensor on `device` without a host sync: on CUDA
    through pinned memory and a non_blocking copy (a pageable copy waits for the stream to
    drain; PyTorch's caching host allocator keeps the pinned block until the copy is done)."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def fill_placeholders_(tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The overlapped step's decode tokens (docs/ENGINE.md §6): tokens [T] int32/int64 on the
    device whose placeholders -1 - r stand for prev[r], the last step's sampled ids [R] that
    the host has not read yet -> filled in place, no host sync (triton: one launch)."""
    from backfit.runtime.kernels import kernel_path
    if kernel_path(tokens):
        from backfit.runtime.kernels.pointwise import fill_placeholders_ as fill
        return fill(tokens, prev)
    hole = tokens < 0
    src = prev[torch.where(hole, -1 - tokens, 0).long()].to(tokens.dtype)
    return tokens.copy_(torch.where(hole, src, tokens))


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
class BatchImages:
    """The image blocks inside a batch (every block whole in its sequence's chunk).

    rows / at: the embedding rows of the image-block positions (sentinels and aligner rows,
    dsv4-vision.md section 10) and their rows in the batch. span_lo / span_hi: per token, the
    window keys it sees beyond the causal window (section 11.2): for a position inside a span
    IMAGE_START a .. IMAGE_END b, (a, b); for every other token its own position twice."""
    rows: torch.Tensor            # [n, d] activation dtype
    at: torch.Tensor              # [n] int64
    span_lo: torch.Tensor         # [T] int32 absolute positions
    span_hi: torch.Tensor         # [T] int32


@dataclass(frozen=True)
class ForwardBatch:
    tokens: torch.Tensor          # [T] int64, sequences concatenated
    positions: torch.Tensor       # [T] int64 absolute positions
    seq_ids: tuple[int, ...]      # one id per sequence (keys of the decoding state)
    seq_lens: tuple[int, ...]     # new tokens per sequence, sum = T
    starts: tuple[int, ...]       # tokens already cached per sequence = position of its first token
    slots: tuple[int, ...] | None = None                     # paged cache: slot per sequence
    block_tables: tuple[tuple[int, ...], ...] | None = None  # paged cache: block ids per sequence
    images: BatchImages | None = None                        # Vision-Exp image blocks

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
        for name in ("slots", "block_tables"):
            v = getattr(self, name)
            if v is not None and len(v) != len(self.seq_ids):
                raise ValueError(f"{name} must have one entry per sequence")

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, Sequence[int] | torch.Tensor, int]],
              device: str | torch.device = "cpu", slots: Sequence[int] | None = None,
              block_tables: Sequence[Sequence[int]] | None = None,
              images: BatchImages | None = None) -> "ForwardBatch":
        """From [(seq_id, new token ids, start position), ...] (+ paged-cache slots/tables,
        image blocks)."""
        toks, pos = [], []
        for _, t, start in seqs:
            t = torch.as_tensor(t, dtype=torch.int64).reshape(-1)
            toks.append(t)
            pos.append(torch.arange(start, start + t.numel(), dtype=torch.int64))
        both = to_device(torch.stack((torch.cat(toks), torch.cat(pos))), torch.int64, device)
        return cls(both[0], both[1],
                   tuple(int(s[0]) for s in seqs), tuple(int(t.numel()) for t in toks),
                   tuple(int(s[2]) for s in seqs),
                   None if slots is None else tuple(int(x) for x in slots),
                   None if block_tables is None else tuple(tuple(int(b) for b in t)
                                                           for t in block_tables), images)

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

    def last_rows_host(self) -> list[int]:
        """Each sequence's last token's row in the flattened batch (host ints)."""
        return [end - 1 for end in accumulate(self.seq_lens)]

    def last_rows(self) -> torch.Tensor:
        """[num_seqs] last_rows_host on the tokens' device (no host sync)."""
        return to_device(self.last_rows_host(), torch.int64, self.tokens.device)

    @cached_property
    def memo(self) -> dict:
        """Tensors derived from this batch alone that every layer of one forward reuses (the
        prefill attention's query blocks and int32 positions: kernels.attention.prefill)."""
        return {}

    @cached_property
    def token_seq_start(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: its sequence's index in the batch and its chunk's first position, int32
        [T] each on the tokens' device; built once per batch (one copy, no host sync)."""
        n = torch.tensor(self.seq_lens)
        seq = torch.repeat_interleave(torch.arange(len(self.seq_lens), dtype=torch.int32), n)
        start = torch.repeat_interleave(torch.tensor(self.starts, dtype=torch.int32), n)
        both = to_device(torch.stack((seq, start)), torch.int32, self.tokens.device)
        return both[0], both[1]
