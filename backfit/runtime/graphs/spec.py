"""CUDA graphs of a speculative decode step (docs/SPECULATIVE.md): draft, verify and the
drafter's context in ONE replay, one graph per batch of b sequences, each with k drafts.

  staged rows   b·(1+k) rows (token, position, slot, block table) as the decode graphs' (row
                i·(1+k)+j: sequence i at position c_i + j; tokens past j = 0 are filled in the
                graph from the draft); one pinned copy a step
  draft         the drafter over the b sequences (x_{c_i} and p_i = c_i - 1 from their first
                row): d_1 .. d_k [b, k] and their logits [b, k, V]; sampled drafts draw from
                the static `noise` and `temperature`, written (eagerly) before each replay
  verify        the target over all b·(1+k) rows as a decode batch whose rows share a slot
                (PagedCache.bind_device(multi_row=True): ring and compressor rows stored before
                any row reads them), logits of every row
  context       the drafter's rings from every row (runtime/drafting.py), each row's previous
                row in the step known at capture (row i·(1+k)+j - 1 for j > 0)
  padding       sequences b' .. b-1 of a partly filled graph: the scratch slot and block,
                position 0, as the decode graphs'

Every graph draws on one memory pool, captured largest first.
"""

from __future__ import annotations

import time

import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.budget import capture_sizes
from backfit.runtime.graphs.decode import capture_graph, pad_decode_inputs, warm_up

__all__ = ["SpecGraphs"]


class SpecGraphs:
    """Captured speculative steps of `model` with `drafting` (k drafts) over `cache`."""

    def __init__(self, model, cache, drafting, max_seqs: int, max_blocks: int,
                 sizes: list[int] | None = None):
        self.model, self.cache, self.drafting = model, cache, drafting
        self.k, self.nblk = drafting.k, max_blocks
        self.R = self.k + 1                                   # rows per sequence
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_seqs)
        dev, rows = cache.device, self.sizes[-1] * self.R
        self.host = torch.empty((rows, 3 + max_blocks), dtype=torch.int32, pin_memory=True)
        self.rows = self.host.numpy()
        pad_decode_inputs([], rows, max_blocks, cache.scratch_slot, cache.scratch_block,
                          self.rows)
        self.stage = self.host.to(dev)
        self.copied = torch.cuda.Event()
        V, bm = model.cfg.vocab_size, self.sizes[-1]
        self.temperature = torch.zeros(bm, device=dev)       # 0: greedy drafts
        self.noise = torch.ones(self.k, bm, V, device=dev)   # Exp(1) draws, sampled drafts
        r = torch.arange(rows, device=dev)
        self.prev = torch.where(r % self.R == 0, -1, r - 1)   # a row's previous row in the step
        self.graphs: dict[int, tuple] = {}
        self.capture_s, self.replays = 0.0, 0

    def _step(self, b: int):
        """The speculative step on the first b sequences' staged rows -> (logits [b·R, V] FP32,
        draft ids [b, k], draft logits [b, k, V] FP32)."""
        from backfit.runtime.model.draft import DraftRows
        R, st = self.R, self.stage[:b * self.R]
        first = st[::R]                                       # each sequence's row 0
        slots, tables = first[:, 2].contiguous(), first[:, 3:].contiguous()
        last = first[:, 1].long() - 1
        rows = DraftRows(first[:, 0].long(), last, slots, tables, self.k,
                         self.temperature[:b], self.noise[:, :b])
        draft = self.drafting.drafter.draft(rows, self.drafting.last_streams(slots, last))
        tokens = st[:, 0].long().view(b, R).clone()
        tokens[:, 1:] = draft.ids
        tokens, pos, row_slots = tokens.flatten(), st[:, 1].long(), st[:, 2].contiguous()
        batch = ForwardBatch(tokens, pos, tuple(range(b * R)), (1,) * (b * R), (0,) * (b * R))
        bound = self.cache.bind_device(row_slots, st[:, 3:].contiguous(), multi_row=True)
        X = self.model.hidden(batch, bound)
        self.drafting.context(X, self.model.taps, tokens, pos, row_slots,
                              prev=self.prev[:b * R])
        return self.model.logits(X), draft.ids, draft.logits

    @torch.no_grad()
    def capture(self, log=None) -> None:
        t, dev, pool = time.perf_counter(), self.cache.device, None
        for b in reversed(self.sizes):
            warm_up(lambda: self._step(b), dev)
            g, out = capture_graph(lambda: self._step(b), pool,
                                   f"the speculative step (batch {b}, k {self.k})",
                                   "--enforce-eager runs without graphs")
            pool = g.pool()
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t
        if log:
            log(f"captured CUDA graphs for speculative steps (k {self.k}) at batch sizes "
                f"{self.sizes} in {self.capture_s:.1f} s")

    def size_for(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n and b in self.graphs), None)

    def run(self, seqs, temperatures: list[float], noise_seed: int):
        """seqs: [(x_c, c, slot, block table)] of sequences that each verify k drafts ->
        (logits [n·R, V], draft ids [n, k], draft logits [n, k, V]) views valid until the next
        replay, or None when no graph fits."""
        b = self.size_for(len(seqs))
        if b is None or any(len(s[3]) > self.nblk for s in seqs):
            return None
        R = self.R
        rows = [(x if j == 0 else 0, c + j, slot, table)
                for x, c, slot, table in seqs for j in range(R)]
        self.copied.synchronize()
        pad_decode_inputs(rows, b * R, self.nblk, self.cache.scratch_slot,
                          self.cache.scratch_block, self.rows[:b * R])
        self.stage[:b * R].copy_(self.host[:b * R], non_blocking=True)
        self.copied.record()
        n = len(seqs)
        self.temperature[:n].copy_(torch.tensor(temperatures), non_blocking=True)
        self.temperature[n:b].zero_()
        if any(t > 0 for t in temperatures):                  # the draws of the sampled drafts
            gen = torch.Generator(device=self.cache.device)
            gen.manual_seed(noise_seed)
            self.noise[:, :b].exponential_(generator=gen).clamp_(min=1e-30)
        g, (logits, ids, dlogits) = self.graphs[b]
        g.replay()
        self.replays += 1
        return logits[:n * R], ids[:n], dlogits[:n]
