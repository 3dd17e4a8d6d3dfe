"""One request's token state, as the scheduler and block manager see it; plain Python, no torch.

Positions 0 .. length-1 are `all_ids` = prompt + output. `num_computed` of them have their KV in
the caches (block i of `block_table` holds positions i*B .. i*B+B-1; `slot` holds the window ring
and compressor rows at position `num_computed`). While running, the tokens still to compute are
all_ids[num_computed:]: a prefill (several, chunked) or one decode token (the last sampled).
A sampled token is appended when its step is launched, as a placeholder -1 - r (row r of that
step's sampled tokens, still on the device), and filled in when the step is resolved; only the
last one or two output ids can be placeholders (scheduler.py, "overlap").

A Vision-Exp prompt carries `images`: (ImageSpan, PreparedImage) pairs (backfit.vision) whose
blocks sit at fixed prompt positions (ids vocab_size + type there). A block is never split: no
chunk boundary and no prefix-cache hit may fall strictly inside one (image_cut,
inside_image, cache_boundary), and the prefix cache keys a block of positions on the contents
of the images it overlaps as well as on the ids (block_key): two images of the same grid have
the same ids.
"""

from __future__ import annotations

import enum

from backfit.engine.sampling_params import SamplingParams

__all__ = ["SequenceStatus", "Sequence"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # in the waiting queue: no slot, no blocks
    RUNNING = "running"      # admitted: owns a slot and blocks (prefilling or decoding)
    FINISHED = "finished"    # done (finish_reason set); everything given back


class Sequence:
    """A request: token ids, its place in the caches, and why it ended."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams | None = None,
                 images: tuple = ()):
        if not prompt_ids:
            raise ValueError(f"request {seq_id}: the prompt is empty (it needs one token at least)")
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.arrival = -1                   # set by Scheduler.add: FIFO; preemption takes the max
        self.num_computed = 0               # positions whose KV is in the caches
        self.slot: int | None = None
        self.block_table: list[int] = []
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache (usage)
        self.prefill_len = 0                # length at admission: the prompt, or prompt + output
        self.num_preemptions = 0
        self.finish_reason: str | None = None   # "stop" | "length" | "abort"
        self.in_flight = 0                  # scheduled steps not yet resolved (overlap: up to 2)
        self.finishing: str | None = None   # ended while in flight: freed when in_flight is 0
        self.images = tuple(images)         # (ImageSpan, PreparedImage) in prompt order

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def __len__(self) -> int:
        return self.length

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_range(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (decode asks for one token per step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    # ---- image blocks (spans: .start, .length, .key; see the module notes) ----
    def inside_image(self, b: int) -> bool:
        """Position boundary b (positions < b on one side) cuts an image block."""
        return any(sp.start < b < sp.start + sp.length for sp, _ in self.images)

    def image_cut(self, start: int, end: int, limit: int) -> int:
        """A chunk from `start` (never inside a block) ending at `end`, moved so it splits no
        image block: back to the block's start, or, for a block at `start`, on to its end if
        that is <= limit; else `start` (nothing runs now)."""
        for sp, _ in self.images:
            if sp.start < end < sp.start + sp.length:
                if sp.start > start:
                    return sp.start
                return sp.start + sp.length if sp.start + sp.length <= limit else start
        return end

    def cache_boundary(self, block_size: int, upto: int | None = None) -> int:
        """A prefix-cache boundary (a snapshot is saved there) at or before `upto` (default:
        prefill_len): the last multiple of block_size <= upto that cuts no image block (0:
        none). A boundary inside a block moves down to before it: the slot's state at a
        position inside an image block is never computed (the block runs in one chunk)."""
        b = (self.prefill_len if upto is None else upto) // block_size * block_size
        while b > 0 and self.inside_image(b):
            b -= block_size
        return b

    def block_key(self, start: int, end: int) -> tuple:
        """What the prefix cache compares for positions start .. end-1: the ids, plus the
        content key and offset of every image block overlapping them."""
        ids = tuple(self.token_range(start, end))
        if not self.images:
            return ids
        return ids + tuple((sp.key, sp.start - start) for sp, _ in self.images
                           if sp.start < end and sp.start + sp.length > start)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt}, "
                f"output={self.num_output}, computed={self.num_computed}, slot={self.slot}, "
                f"blocks={len(self.block_table)}, finish={self.finish_reason})")
