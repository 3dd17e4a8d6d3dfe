"""The runner's side of speculative decoding: drafting at the start of a step, the drafter's
context after every forward, and the checks of a speculative config (docs/SPECULATIVE.md).

A sequence that drafts in a step (StepSeq.draft = k > 0) comes with one token, x_c (sampled last
step, not in the cache; c = its position). `Drafting.draft` drafts d_1 .. d_k after p = c - 1 on
the device, and the step's forward runs [x_c, d_1, ..., d_k] at c .. c + k (the drafts filled in
on the device, as the overlapped step's placeholders are); every row is sampled.

`Drafting.context` runs after every forward, plain decode and prefill chunks included, so the
drafter's rings always hold what the target computed, whether this step drafted or not (the
engine turns speculation off above a batch size): DSpark's stage rings take main_kv of every
row; MTP's ring takes the block's KV of (X_{t-1}, x_t) for every row t, X_{t-1} the streams of
the row before (this forward's, or the per-slot `streams` buffer for a chunk's first row). Rows
past a verify step's accepted ones land at later positions: never read, rewritten later.
A prefix-cache snapshot (docs/ENGINE.md §3) carries the drafter rings (PagedCache's snapshot
pool) and, for MTP, X at the boundary's last position: the first row after a restore at boundary
b writes the ring row b - 1 from it, as any chunk's first row does from `streams`.

Drafter state is keyed by slot and position, never by batch row: a sequence that moves rows (the
batch compacts) or leaves and comes back (preemption recomputes its prompt) drafts against its own
rings. Sampled drafts draw from noise made by the step's seed (StepInput.draft_seed), so every TP
rank draws the same drafts from the same all-gathered logits.
"""

from __future__ import annotations

import torch

from backfit.runtime.batch import to_device
from backfit.runtime.cache.paged import ROLLBACK
from backfit.runtime.model.draft import Draft, DraftRows, drafter_for

__all__ = ["Drafting", "RowPlan", "check_speculative"]

METHODS = {"mtp": "flash", "dspark": "0731"}


def check_speculative(method: str | None, k: int, cfg) -> None:
    """One-line errors for a speculative config the checkpoint or the pools cannot serve."""
    if method is None:
        if k:
            raise ValueError("num_speculative_tokens needs a method (mtp or dspark)")
        return
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r}: choose one of {', '.join(METHODS)}")
    if cfg.variant != METHODS[method] or not cfg.num_mtp_stages:
        have = {"flash": "mtp (Flash's MTP block)", "0731": "dspark (0731's DSpark stages)"}
        raise ValueError(f"speculative method {method!r} needs a DeepSeek-V4-"
                         f"{'Flash' if method == 'mtp' else 'Flash-0731'} checkpoint; this one "
                         f"drafts with {have.get(cfg.variant, 'nothing')}")
    most = ROLLBACK - 1 if method == "mtp" else min(ROLLBACK - 1, cfg.dspark_block_size)
    if not 1 <= k <= most:
        raise ValueError(f"num_speculative_tokens {k}: {method} verifies 1..{most} drafted "
                         f"tokens a step (the pools roll back {ROLLBACK} tokens"
                         f"{'' if method == 'mtp' else f', a DSpark block drafts {cfg.dspark_block_size}'})")


class RowPlan:
    """Which rows of a forward the context writes (the last ones a ring keeps, per sequence)
    and each one's previous row in the forward (-1: the sequence's row before the forward),
    built on the host once per forward from the sequences' row counts."""

    def __init__(self, lens: list[int], ring: int, device):
        rows, prev, keep, lo = [], [], [], 0
        for n in lens:
            mine = range(lo + max(0, n - ring), lo + n)
            rows += mine
            prev += (r - 1 if r > lo else -1 for r in mine)
            keep += range(lo + max(0, n - ROLLBACK), lo + n)
            lo += n
        both = to_device([rows, prev], torch.int64, device)
        self.rows, self.prev = both[0], both[1]
        self.keep = to_device(keep, torch.int64, device)


class Drafting:
    """One rank's drafter over the model's drafter blocks and the runner's pools."""

    def __init__(self, model, cache, num_slots: int, k: int, num_snapshots: int = 0):
        self.drafter, self.cache, self.k = drafter_for(model, cache), cache, k
        self.ring = model.cfg.sliding_window + ROLLBACK
        self.vocab = model.cfg.vocab_size
        self.streams = self.snap_streams = None
        if self.drafter.needs_streams:              # MTP: X of the last ROLLBACK rows per slot
            cfg = model.cfg
            self.streams = torch.zeros(num_slots + 1, ROLLBACK, cfg.hc_mult, cfg.hidden_size,
                                       dtype=model.dtype, device=cache.device)
            self.snap_streams = torch.zeros(num_snapshots, cfg.hc_mult, cfg.hidden_size,
                                            dtype=model.dtype, device=cache.device)

    def snapshot(self, slot: int, snap: int, boundary: int, save: bool) -> None:
        """Save (slot -> snapshot) or restore (snapshot -> slot) X at position boundary - 1 (MTP;
        the drafter rings travel in the cache's snapshot pool)."""
        if self.streams is not None:
            row = (boundary - 1) % ROLLBACK
            if save:
                self.snap_streams[snap] = self.streams[slot, row]
            else:
                self.streams[slot, row] = self.snap_streams[snap]

    def rows(self, tokens, last, slots, tables, temps, seed: int, host=None) -> DraftRows:
        """DraftRows over device tensors (tokens, last, slots, tables: [S] / [S, nblk]); temps
        [S] host floats (0: greedy); sampled drafts get Exp(1) noise from `seed`."""
        dev, noise, temperature = self.cache.device, None, None
        if any(t > 0 for t in temps):
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
            noise = torch.empty(self.k, len(temps), self.vocab, device=dev)
            noise.exponential_(generator=gen).clamp_(min=1e-30)
            temperature = to_device(temps, torch.float32, dev)
        return DraftRows(tokens, last, slots, tables, self.k, temperature, noise, host)

    def draft(self, seqs, seed: int) -> Draft:
        """The drafting StepSeqs (eager) -> Draft of k tokens each (ids [S, k] on the device)."""
        dev = self.cache.device
        n = max(len(s.block_table) for s in seqs)
        both = to_device([[s.tokens[0] for s in seqs], [s.start - 1 for s in seqs],
                          [s.slot for s in seqs]], torch.int64, dev)
        tables = to_device([list(s.block_table) + [0] * (n - len(s.block_table)) for s in seqs],
                           torch.int32, dev)
        host = (tuple(s.seq_id for s in seqs), tuple(s.slot for s in seqs),
                tuple(s.block_table for s in seqs), tuple(s.start - 1 for s in seqs))
        rows = self.rows(both[0], both[1], both[2].int(), tables, [s.temperature for s in seqs],
                         seed, host)
        return self.drafter.draft(rows, self.last_streams(both[2], both[1]))

    def last_streams(self, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor | None:
        """MTP: the streams of each sequence at position `last` ([S, 4, d]); None for DSpark."""
        if self.streams is None:
            return None
        return self.streams[slots.long(), last % ROLLBACK]

    def context(self, X: torch.Tensor, taps, tokens: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor, plan: RowPlan | None = None,
                prev: torch.Tensor | None = None) -> None:
        """After a forward of rows (tokens, pos, slots: [T] device tensors; X [T, 4, d]; taps
        [T, n·d] or None): the drafter's rings, then (MTP) the streams of the rows a slot
        keeps. plan: the eager path's row selection (RowPlan); else every row is written and
        prev [T] (the previous row in this forward, -1: none) must be given (CUDA graphs)."""
        rows, prev = (plan.rows, plan.prev) if plan is not None else (None, prev)
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        tok, p, sl = pick(tokens), pick(pos), pick(slots)
        X_prev = None
        if self.streams is not None:
            saved = self.streams[sl.long(), (p - 1) % ROLLBACK]               # before the save
            X_prev = torch.where((prev >= 0)[:, None, None], X[prev.clamp(min=0)], saved)
        self.drafter.context(X_prev, None if taps is None else pick(taps), tok, p, sl)
        if self.streams is not None:
            keep = (lambda t: t) if plan is None else (lambda t: t.index_select(0, plan.keep))
            self.streams[keep(slots).long(), keep(pos) % ROLLBACK] = keep(X)
