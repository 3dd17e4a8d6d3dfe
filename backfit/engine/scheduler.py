"""Continuous batching: which tokens of which sequences run in the next forward; plain Python.

One step = decode tokens of running sequences + prefill chunks (of admitted, partially prefilled
sequences and of newly admitted ones) under `max_num_batched_tokens` and `max_num_seqs`. Per step
the engine calls schedule() -> runner -> advance(step) -> resolve(step, sampled); postprocess is
advance + resolve. advance (right after the launch) moves num_computed on and appends each
sampled token as a placeholder -1 - r (row r of the step's sampled tokens, on the device);
resolve fills the placeholders with the host's tokens and applies the token-level stops.
Overlap (docs/ENGINE.md §6): schedule() may run while one advanced step is still unresolved:
its decode tokens are then that step's placeholders, which the runner takes from the device.
Sequences that end at the pending resolve whatever its token (max_tokens, max_model_len) are
not scheduled again. finish() or abort() of a sequence some unresolved step still holds is
applied when the last such step resolves (the runner may still be reading its blocks); until
then it is skipped, and a token-level stop found one step late drops the step after it.

Order: running sequences by arrival (decode tokens are reserved out of the budget before a prefill
chunk takes it), then waiting ones FIFO (no admission in a step that preempted). A chunk that
cannot take the whole remaining prefill ends on a block boundary where the budget allows; with
prefix caching every boundary chosen for a snapshot (docs/ENGINE.md §3: every
`snapshot_interval` blocks, the request's cache_boundaries, the prefill's last full-block
boundary) is a chunk end, so the slot holds the state there and its snapshot can be saved. A
chunk never ends inside an image block (Sequence.image_cut: before the block, or after it when
the block starts the chunk), and a chosen boundary inside one moves down to the last block
boundary before it (Sequence.cache_boundary). When blocks run out the newest running sequence
not yet in the step is preempted by recompute (it may be the one asking): everything is given
back and it re-enters the front of the waiting queue, to prefill prompt + output again (prefix
cache hits included).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from backfit.engine.block_manager import BlockManager
from backfit.engine.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSeq", "ScheduledStep", "Scheduler"]


class ScheduledSeq(NamedTuple):
    seq: Sequence            # slot and block_table as they are when the step runs
    start: int               # position of token_ids[0]; the forward writes start .. start+n-1
    token_ids: list[int]
    sample: bool             # the chunk reaches the last known token: sample the next one
    draft: int = 0           # speculative: k tokens drafted after token_ids (one token) and
    #                          verified in the same forward (positions start .. start + k)


@dataclass
class ScheduledStep:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)   # (snapshot, seq slot): before
    saves: list[tuple[int, int]] = field(default_factory=list)      # (seq slot, snapshot): after
    preempted: list[int] = field(default_factory=list)              # seq ids, newest first

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True,
                 eos_token_id: int | Iterable[int] | None = None,
                 num_speculative_tokens: int = 0, speculative_max_batch: int | None = None,
                 snapshot_interval: int | None = None):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        B = block_manager.block_size
        if snapshot_interval is None:               # every full chunk of a fresh prefill
            snapshot_interval = max(1, max_num_batched_tokens // B)
        if not isinstance(snapshot_interval, int) or snapshot_interval < 0:
            raise ValueError(f"prefix snapshot interval must be an integer >= 0 (blocks; 0: "
                             f"none), got {snapshot_interval!r}")
        self.snapshot_every = snapshot_interval * B     # tokens between periodic snapshots
        self.bm = block_manager
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        eos = [] if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.eos = frozenset(eos)
        self.waiting: deque[Sequence] = deque()   # by arrival; preempted ones at the front
        self.running: list[Sequence] = []         # by arrival
        self.seqs: dict[int, Sequence] = {}       # every unfinished sequence
        self._arrivals = itertools.count()
        self.num_preemptions = 0                  # since start (a statistic)
        self._unadvanced = False                  # schedule() returned a step not advanced
        self._unresolved = 0                      # advanced steps not yet resolved (0..2)
        self._external: set[int] = set()          # deferred finish() calls, reported when freed
        self.k = num_speculative_tokens           # drafts per speculative decode (0: off)
        self.spec_max_batch = speculative_max_batch  # no speculation with more decodes than this

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError (one line: what to change) if it can never run."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"request id {seq.seq_id} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.output_ids or seq.block_table:
            raise ValueError(f"request {seq.seq_id} is not a new sequence")
        p, params, L, B = seq.num_prompt, seq.params, self.max_model_len, self.bm.block_size
        least = max(1, params.min_tokens)           # what it must generate before it may stop
        if p + least > L:
            raise ValueError(f"request {seq.seq_id}: {p} prompt tokens + {least} output tokens "
                             f"exceed max_model_len {L}; shorten the prompt")
        longest = L if params.max_tokens is None else min(L, p + params.max_tokens)
        need = self.bm.blocks_for(longest - 1)      # the last token's KV is never computed
        if need > self.bm.num_blocks:
            raise ValueError(f"request {seq.seq_id}: up to {longest} tokens need {need} cache "
                             f"blocks of {B} but the pool has {self.bm.num_blocks}; lower "
                             f"max_tokens or max_model_len, or give the KV cache more memory")
        block = max((sp.length for sp, _ in seq.images), default=0)
        if block > self.max_num_batched_tokens:     # an image block runs in one chunk
            raise ValueError(f"request {seq.seq_id}: an image block of {block} positions "
                             f"exceeds max_num_batched_tokens {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and p > self.max_num_batched_tokens:
            raise ValueError(f"request {seq.seq_id}: {p} prompt tokens exceed "
                             f"max_num_batched_tokens {self.max_num_batched_tokens} with chunked "
                             f"prefill off; enable chunked prefill or raise the token budget")
        seq.arrival = next(self._arrivals)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        if self._unadvanced or self._unresolved > 1:
            raise RuntimeError("schedule() called before advance() of the last step, or with two "
                               "steps unresolved")
        step, budget = ScheduledStep(), self.max_num_batched_tokens
        running = self.running
        decodes_left = sum(1 for s in running
                           if s.length - s.num_computed == 1 and not self._ends(s))
        speculate = self.k > 0 and self._unresolved == 0 and (
            self.spec_max_batch is None or decodes_left <= self.spec_max_batch)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if self._ends(seq):                 # ends at a pending resolve: nothing to run
                i += 1
                continue
            todo = seq.length - seq.num_computed
            if todo <= 0:
                raise RuntimeError(f"sequence {seq.seq_id} has no token to run (rolled back "
                                   f"without appending the next one?)")
            k = 0
            if todo == 1:
                decodes_left -= 1
                n = 1
                if speculate:                   # drafts from what the budget leaves over
                    k = min(self._draft_room(seq), max(0, budget - 1 - decodes_left))
            elif self._chunkable(seq):          # leave one token per later decode
                n = self._chunk(seq, seq.num_computed, budget - decodes_left)
            else:
                n = todo if todo <= budget else 0
            if n <= 0:
                i += 1
                continue
            while not self.bm.grow(seq, n + k):
                victim = next(v for v in reversed(running) if not self._ends(v))
                #                                 newest not yet in the step (all after i)
                if victim is not seq and victim.length - victim.num_computed == 1:
                    decodes_left -= 1           # its reserved token is free again
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                if k:
                    step.seqs.append(ScheduledSeq(seq, seq.num_computed,
                                                  seq.token_range(seq.num_computed, seq.length),
                                                  True, k))
                else:
                    self._emit(step, seq, n)
                budget -= n + k
                i += 1
        while (self.waiting and budget > 0 and not step.preempted
               and len(running) < self.max_num_seqs and self.bm.num_free_slots):
            seq = self.waiting[0]
            seq.prefill_len = seq.length
            hit = self.bm.match(seq)
            todo = seq.length - hit.num_tokens
            if self._chunkable(seq):
                n = self._chunk(seq, hit.num_tokens, budget)
            else:
                n = todo if todo <= budget else 0
            if n <= 0 or not self.bm.can_admit(hit, hit.num_tokens + n):
                break                               # FIFO: nobody overtakes the head
            self.waiting.popleft()
            restore = self.bm.admit(seq, hit)
            if restore is not None:
                step.restores.append(restore)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(running, seq, key=lambda s: s.arrival)
            assert self.bm.grow(seq, n)
            self._emit(step, seq, n)
            budget -= n
        for item in step.seqs:
            item.seq.in_flight += 1
        self._unadvanced = bool(step.seqs)        # an empty step needs no advance()
        return step

    def advance(self, step: ScheduledStep) -> None:
        """The step is launched: num_computed moves on, blocks register, and every sampled
        row's token is appended as the placeholder -1 - r (r: its row among the sampled)."""
        r = 0
        for item in step.seqs:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING and seq.finishing is None:
                seq.num_computed = item.start + len(item.token_ids)
                self.bm.commit(seq)
                if item.sample:
                    seq.output_ids.append(-1 - r)
            r += item.sample
        self._unadvanced = False
        self._unresolved += bool(step.seqs)

    def resolve(self, step: ScheduledStep, sampled: dict[int, int]) -> list[Sequence]:
        """Fill the step's placeholders with the sampled tokens and apply token-level stops;
        returns the sequences that ended (freed, or freed when the last step holding them
        resolves), and those whose deferred finish() is applied now."""
        finished = []
        for item in step.seqs:
            seq = item.seq
            seq.in_flight -= 1
            if item.sample and seq.finishing is None and not seq.is_finished:
                if seq.seq_id not in sampled:
                    raise KeyError(f"no sampled token for sequence {seq.seq_id} (its row asked)")
                k = item.start + len(item.token_ids) - seq.num_prompt   # its output index
                got = sampled[seq.seq_id]
                for j, token in enumerate(got if isinstance(got, list) else [got]):
                    if j:                       # speculative: the draft's row is computed
                        seq.num_computed += 1
                        seq.output_ids.append(token)
                    else:
                        seq.output_ids[k] = token
                    reason = self._stop_reason(seq, token, k + j + 1)
                    if reason is not None:      # later tokens of the accepted run: dropped
                        self._end(seq, reason)
                        finished.append(seq)
                        break
                else:
                    if item.draft:
                        self.bm.commit(seq)
            if seq.finishing is not None and seq.in_flight == 0:
                reason, seq.finishing = seq.finishing, None
                self._finish(seq, reason)
                if seq.seq_id in self._external:
                    self._external.discard(seq.seq_id)
                    finished.append(seq)
        self._unresolved -= bool(step.seqs)
        return finished

    def postprocess(self, step: ScheduledStep, sampled: dict[int, int]) -> list[Sequence]:
        """advance + resolve (no overlap): the sequences that finished, already freed."""
        self.advance(step)
        return self.resolve(step, sampled)

    def finish(self, seq_id: int, reason: str = "stop") -> Sequence | None:
        """End a request (the engine matched a stop string); None if it is not active. A running
        one that an unresolved step still holds ends when that step resolves (and is returned
        by that resolve); it is not scheduled again meanwhile."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.finishing is not None:
            return None
        if seq.in_flight and seq.status is SequenceStatus.RUNNING:
            self._external.add(seq_id)          # reported by the resolve that frees it
        self._end(seq, reason)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request, waiting or running, giving back its slot, blocks and snapshots."""
        return self.finish(seq_id, "abort")

    # ---- internals ----
    def _draft_room(self, seq: Sequence) -> int:
        """Drafts a decoding seq may verify this step: k, fewer where max_model_len or
        max_tokens would cut the emitted run anyway (1 + k tokens at most)."""
        room = self.max_model_len - 1 - seq.num_computed     # positions c .. c + k < L
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output - 1)
        return max(0, min(self.k, room))

    def _chunkable(self, seq: Sequence) -> bool:
        # a preempted sequence's prompt + output may exceed the budget: it must still progress
        return self.enable_chunked_prefill or seq.length > self.max_num_batched_tokens

    def _chunk(self, seq: Sequence, start: int, avail: int) -> int:
        """Tokens of the prefill from `start` to run now, at most avail (0: none)."""
        if avail <= 0:
            return 0
        B, end = self.bm.block_size, min(seq.length, start + avail)
        if end < seq.length and end // B * B > start:
            end = end // B * B                      # a partial chunk ends on a block boundary
        nxt = self._next_boundary(seq, start)
        if nxt is not None and nxt < end:
            end = nxt                               # ... a chunk end (its snapshot)
        if seq.images:                              # never inside an image block (a chosen
            end = seq.image_cut(start, end, start + avail)   # boundary is never inside one)
        return end - start

    def _next_boundary(self, seq: Sequence, start: int) -> int | None:
        """The first boundary after `start` chosen for a prefix-cache snapshot, up to the
        prefill's last full-block boundary (docs/ENGINE.md §3); None without snapshots."""
        if not self.bm.saves_snapshots:
            return None
        B, every = self.bm.block_size, self.snapshot_every
        last = seq.cache_boundary(B)                # prefill_len // B * B, before any image
        chosen = [last] + [h // B * B for h in seq.params.cache_boundaries]
        if every:
            p = (start // every + 1) * every
            while seq.images and p < last and seq.cache_boundary(B, p) <= start:
                p += every                          # moved down to `start` or before: the next
            chosen.append(p)
        if seq.images:                              # one inside an image block moves down to
            chosen = [seq.cache_boundary(B, b) for b in chosen]   # before it (never computed)
        return min((b for b in chosen if start < b <= last), default=None)

    def _emit(self, step: ScheduledStep, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        end = start + n
        step.seqs.append(ScheduledSeq(seq, start, seq.token_range(start, end), end == seq.length))
        B = self.bm.block_size
        if end % B == 0 and (end > seq.prefill_len or end == self._next_boundary(seq, start)):
            save = self.bm.plan_save(seq, end, decode=end > seq.prefill_len)
            if save is not None:
                step.saves.append(save)

    def _stop_reason(self, seq: Sequence, token: int, n_out: int) -> str | None:
        """Why seq ends at `token`, its n_out-th output id (None: it goes on)."""
        p = seq.params
        if n_out >= p.min_tokens and (
                (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        return "length" if self._at_length(seq, n_out) else None

    def _at_length(self, seq: Sequence, n_out: int) -> bool:
        """n_out output ids reach max_tokens or max_model_len."""
        p = seq.params
        return (p.max_tokens is not None and n_out >= p.max_tokens) or \
            seq.num_prompt + n_out >= self.max_model_len

    def _ends(self, seq: Sequence) -> bool:
        """seq ends when the steps holding it resolve: finishing, or at a length limit whatever
        its pending token is (only while a step holds it; otherwise it has ended already)."""
        return seq.finishing is not None or (seq.in_flight > 0
                                             and self._at_length(seq, seq.num_output))

    def _end(self, seq: Sequence, reason: str) -> None:
        """seq ends now: freed at once, or (held by an unresolved step) marked finishing, with
        the placeholders past its last token dropped."""
        if seq.in_flight and seq.status is SequenceStatus.RUNNING:
            seq.finishing = seq.finish_reason = reason
            while seq.output_ids and seq.output_ids[-1] < 0:
                seq.output_ids.pop()
        else:
            self._finish(seq, reason)

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.bm.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)               # newest first, so the oldest ends in front
        step.preempted.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.bm.free(seq)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self.seqs[seq.seq_id]
