"""The runner's side of speculative decoding: drafting at the start of a step, the drafter's
context after the forward, and the verify rows' layout (docs/ENGINE.md §7).

A sequence that drafts in a step (StepSeq.draft = k > 0) comes with one token, x_c (sampled last
step, not in the cache; c = its position). `Drafting.draft` drafts d_1 .. d_k after position
p = c - 1 on the device, and the step's forward runs [x_c, d_1, ..., d_k] at c .. c + k (the drafts
filled in on the device, as the overlapped step's placeholders are); every row is sampled. After
the forward `Drafting.context` fills the drafter's rings from all the forward's rows (prefill
chunks and verify rows alike): row t's next token is the chunk's next row, the step's `next_token`
after a chunk that does not end the known tokens, else a stand-in the next draft rewrites. For
MTP it also keeps the streams of each sequence's last ROLLBACK rows per slot (`streams`, by
position): the next draft starts from X at the last accepted position, whichever it is. An MTP
ring row depends on the row's next token, so the row before each chunk that does not draft (a
prefill chunk, a plain decode token) is rewritten from `streams` with the chunk's first token:
after a prefix-cache restore that row came from the request that saved the snapshot, after a
plain decode step it held a stand-in. A prefix-cache snapshot (docs/ENGINE.md §3) carries the
drafter rings (PagedCache's snapshot pool) and, for MTP, X at the boundary's last position.

Drafter state is keyed by slot and position, never by batch row: a sequence that moves rows (the
batch compacts) or leaves and comes back (preemption recomputes its prompt) drafts against its own
rings. Draft draws use a generator seeded by the step (StepInput.draft_seed), so every TP rank
draws the same drafts from the same all-gathered logits.
"""

from __future__ import annotations

import torch

from backfit.runtime.batch import ForwardBatch, to_device
from backfit.runtime.cache.paged import ROLLBACK
from backfit.runtime.model.draft import Draft, DraftRows, drafter_for

__all__ = ["Drafting", "check_speculative"]

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


class Drafting:
    """One rank's drafter over the model's drafter blocks and the runner's pools."""

    def __init__(self, model, cache, num_slots: int, k: int, num_snapshots: int = 0):
        self.drafter, self.cache, self.k = drafter_for(model), cache, k
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

    def draft(self, seqs, seed: int) -> Draft:
        """The drafting StepSeqs -> Draft of k tokens each (ids [S, k] on the device)."""
        dev = self.cache.device
        temps = [s.temperature for s in seqs]
        gen = None
        if any(t > 0 for t in temps):
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
        rows = DraftRows(tuple(s.seq_id for s in seqs), tuple(s.slot for s in seqs),
                         tuple(s.block_table for s in seqs), tuple(s.start - 1 for s in seqs),
                         to_device([s.tokens[0] for s in seqs], torch.int64, dev), self.k,
                         to_device(temps, torch.float32, dev) if gen is not None else None, gen)
        X_last = None
        if self.streams is not None:
            at = to_device([[s.slot for s in seqs], [(s.start - 1) % ROLLBACK for s in seqs]],
                           torch.int64, dev)
            X_last = self.streams[at[0], at[1]]                                # [S, 4, d]
        return self.drafter.draft(rows, self.cache, X_last)

    def context(self, X: torch.Tensor, taps, batch: ForwardBatch, seqs, bound) -> None:
        """After the forward: the drafter's rings from every row (see the module notes)."""
        lens = [len(s.tokens) + s.draft for s in seqs]
        if self.streams is not None:                     # before `streams` takes this forward
            self._rewrite_rows_before(seqs, lens, batch, bound)
        T, idx, lo = X.shape[0], [], 0
        for i, (s, n) in enumerate(zip(seqs, lens)):     # the next row, a known next token
            idx += range(lo + 1, lo + n)                 # (T + 1 + i) or the stand-in (T)
            idx.append(T + 1 + i if s.next_token >= 0 and not s.draft else T)
            lo += n
        extra = to_device([0] + [max(s.next_token, 0) for s in seqs], torch.int64, X.device)
        nxt = torch.cat((batch.tokens, extra))[to_device(idx, torch.int64, X.device)]
        self.drafter.context(X, taps, nxt, batch, bound)
        if self.streams is not None:
            rows, slots, pos, lo = [], [], [], 0
            for s, n in zip(seqs, lens):
                keep = range(max(0, n - ROLLBACK), n)
                rows += (lo + t for t in keep)
                slots += [s.slot] * len(keep)
                pos += ((s.start + t) % ROLLBACK for t in keep)
                lo += n
            at = to_device([rows, slots, pos], torch.int64, X.device)
            self.streams[at[1], at[2]] = X[at[0]]

    def _rewrite_rows_before(self, seqs, lens, batch: ForwardBatch, bound) -> None:
        """MTP: the ring row at start - 1 of each chunk that does not draft, from X there
        (`streams`) and the chunk's first token (the batch's: placeholders are filled)."""
        slots, rows, firsts, pos, lo = [], [], [], [], 0
        for s, n in zip(seqs, lens):
            if s.start > 0 and not s.draft:
                slots.append(s.slot)
                rows.append((s.start - 1) % ROLLBACK)
                firsts.append(lo)
                pos.append(s.start - 1)
            lo += n
        if slots:
            at = to_device([slots, rows, firsts, pos], torch.int64, batch.tokens.device)
            self.drafter.rewrite(self.streams[at[0], at[1]], batch.tokens[at[2]], at[3], at[0],
                                 bound)
