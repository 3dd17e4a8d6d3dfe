"""CUDA graphs of the decode step (docs/ENGINE.md §4): one graph per padded batch size.

A pure-decode step (every sequence one new token, all sampling, no prompt logprobs) on the
Triton kernels has no host sync and no data-dependent shape: the attention kernels, the indexer,
the fused MoE and the batched compressor update (Compressor.decode_update) read positions, slots
and block tables from the device. So the step (embedding -> blocks -> hc_head -> head, FP32
logits [B, V]) is captured once per batch size B in `capture_sizes` and replayed with new inputs:

  static input    one int32 staging tensor [Bmax, 3 + nblk] on the device, row b = (token,
                  position, slot, block table of nblk entries; nblk = blocks of max_model_len),
                  filled by ONE copy from a pinned host twin per step; the graph starts by
                  taking tokens/positions (int64) and slots/tables (int32) out of it
  padding         rows n..B-1 of a batch of n decode with token 0 at position 0 in the cache's
                  scratch slot, every table entry the scratch block: nothing real is touched
  memory          every graph draws on one shared pool, captured largest first

Prefill chunks and mixed steps take runtime/prefill_graphs.py's pieces (or run eagerly);
batches above the largest size run eagerly, as does everything with --enforce-eager. Capture warms each size up once on a side stream (Triton compiles there).
At tp > 1 the graphs hold the step's NCCL collectives: every rank captures the same sizes in the
same order (the same RunnerConfig), and for a step every rank replays the same graph or none
(the step is broadcast; size_for and the table check depend on it alone).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from backfit.runtime.batch import ForwardBatch, fill_placeholders_
from backfit.runtime.cache.budget import capture_sizes

__all__ = ["pad_decode_inputs", "DecodeGraphs", "capture_mode", "warm_up", "capture_graph",
           "mismatch"]

_ROW_LOOP = 8            # up to this many sequences pad_decode_inputs fills row by row


def capture_mode() -> str:
    """torch.cuda.graph's capture_error_mode. tp > 1: NCCL's watchdog thread polls the events
    of eager collectives (the warm-up's); "global" mode would fail such a call from another
    thread mid-capture, so the capture is thread-local (and starts with nothing in flight)."""
    from backfit.runtime.distributed import get_tp_info
    return "thread_local" if get_tp_info().size > 1 else "global"


def warm_up(fn, dev: torch.device) -> None:
    """fn() once on a side stream before its capture (Triton compiles, workspaces, NCCL
    communicators), then a device sync: the capture starts with nothing in flight."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)


def capture_graph(fn, pool, what: str, fix: str):
    """fn() captured into a new graph drawing on `pool` (None: a new one) -> (graph, fn's
    result); a failed capture raises naming `what` and the flag that avoids it (`fix`)."""
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, pool=pool, capture_error_mode=capture_mode()):
            out = fn()
    except RuntimeError as e:
        raise RuntimeError(f"CUDA-graph capture of {what} failed: {e}; {fix}") from e
    return g, out


def mismatch(got: torch.Tensor, want: torch.Tensor, rel_max: float, got_is: str,
             want_is: str) -> str | None:
    """None if ||got - want|| / ||want|| < rel_max (False for NaN too), else what differs."""
    rel = float((got - want).float().norm() / want.float().norm())
    if rel < rel_max:
        return None
    return f"{got_is} differ from {want_is} (relative error {rel:.3g}, bound {rel_max:g})"


def pad_decode_inputs(seqs, B: int, nblk: int, scratch_slot: int, scratch_block: int,
                      out: np.ndarray | None = None) -> np.ndarray:
    """seqs: [(token, position, slot, block table)] (n <= B) -> the padded batch as int32 rows
    [B, 3 + nblk] = (token, position, slot, table...), written into `out` (a pinned staging view)
    when given. Vectorized (numpy) from _ROW_LOOP + 1 sequences (~30 us at batch 64 where a
    row-by-row fill took ~500); row by row below, where numpy's per-call overhead dominates
    (batch 1: ~3 us, ~10 with the vectorized checks)."""
    n = len(seqs)
    if n > B:
        raise ValueError(f"{n} sequences do not fit a graph of batch {B}")
    if n <= _ROW_LOOP:                  # small batches: plain Python, numpy's per-call cost
        longest = max((len(s[3]) for s in seqs), default=0)       # dominates below ~8 rows
        if longest > nblk:
            raise ValueError(f"block table of {longest} blocks, graphs hold {nblk}")
        rows = np.empty((B, 3 + nblk), dtype=np.int32) if out is None else out
        for i, (token, position, slot, table) in enumerate(seqs):
            r, k = rows[i], 3 + len(table)
            r[:k] = (token, position, slot, *table)
            r[k:] = scratch_block
        if n < B:
            rows[n:, :3] = (0, 0, scratch_slot)
            rows[n:, 3:] = scratch_block
        return rows
    lens = np.fromiter((len(s[3]) for s in seqs), dtype=np.int64, count=n)
    if int(lens.max()) > nblk:
        raise ValueError(f"block table of {int(lens.max())} blocks, graphs hold {nblk}")
    rows = np.empty((B, 3 + nblk), dtype=np.int32) if out is None else out
    rows[:, :3] = (0, 0, scratch_slot)
    rows[:, 3:] = scratch_block
    if n:
        rows[:n, :3] = np.array([s[:3] for s in seqs], dtype=np.int32)
    total = int(lens.sum())
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(s[3] for s in seqs), dtype=np.int32,
                           count=total)
        r = np.repeat(np.arange(n), lens)
        c = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        rows[r, 3 + c] = flat
    return rows


class DecodeGraphs:
    """Captured decode steps of `model` over `cache` (a PagedCache with its scratch slot/block)."""

    def __init__(self, model, cache, max_num_seqs: int, max_blocks: int, drafting=None):
        self.model, self.cache, self.nblk = model, cache, max_blocks
        self.drafting = drafting                           # speculative decoding configured:
        #                                                    the drafter's context in the graph
        self.sizes = capture_sizes(max_num_seqs)
        dev, Bm = cache.device, self.sizes[-1]
        self.host = torch.empty((Bm, 3 + max_blocks), dtype=torch.int32, pin_memory=True)
        self.rows = self.host.numpy()                      # the pinned buffer, seen by numpy
        pad_decode_inputs([], Bm, max_blocks, cache.scratch_slot, cache.scratch_block, self.rows)
        self.stage = self.host.to(dev)                     # the graphs' one static input
        self.copied = torch.cuda.Event()                   # the last copy out of self.host
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s, self.replays = 0.0, 0

    def _step(self, B: int) -> torch.Tensor:
        """The decode forward on the first B staging rows -> logits [B, V] FP32."""
        st = self.stage[:B]
        batch = ForwardBatch(st[:, 0].long(), st[:, 1].long(), tuple(range(B)), (1,) * B,
                             (0,) * B)
        slots = st[:, 2].contiguous()
        bound = self.cache.bind_device(slots, st[:, 3:].contiguous())
        X = self.model.hidden(batch, bound)
        if self.drafting is not None:                     # one row per sequence: no previous
            self.drafting.context(X, self.model.taps, batch.tokens, batch.positions, slots,
                                  prev=torch.full((B,), -1, dtype=torch.int64, device=X.device))
        return self.model.logits(X)

    @torch.no_grad()
    def capture(self, log=None) -> None:
        """Capture every size, largest first, into one memory pool (inputs: all padding)."""
        t, dev = time.perf_counter(), self.cache.device
        pool = None
        for B in reversed(self.sizes):
            warm_up(lambda: self._step(B), dev)
            g, out = capture_graph(lambda: self._step(B), pool, f"the decode step (batch {B})",
                                   "--enforce-eager runs without graphs")
            pool = g.pool()
            self.graphs[B] = (g, out)
        torch.cuda.synchronize(self.cache.device)
        self.capture_s = time.perf_counter() - t
        if log:
            log(f"captured CUDA graphs for decode batch sizes {self.sizes} in "
                f"{self.capture_s:.1f} s")

    @torch.no_grad()
    def check(self, rel_max: float = 1e-2) -> str | None:
        """The smallest graph replayed on the padding rows against the eager step on the same
        rows: None if ||graph - eager|| / ||eager|| < rel_max (bit-equal at tp 1, GPU test
        test_graph_replay_equals_eager; the bound leaves room for another summation order in
        NCCL), else what differs. At tp > 1 this is where the collectives captured inside a
        graph first meet a reference; the logits are all-gathered, so every rank computes the
        same verdict and every rank keeps or drops its graphs alike (runner.capture_graphs)."""
        B = self.sizes[0]
        pad_decode_inputs([], B, self.nblk, self.cache.scratch_slot, self.cache.scratch_block,
                          self.rows[:B])
        self.stage[:B].copy_(self.host[:B])
        want = self._step(B).clone()
        g, out = self.graphs[B]
        g.replay()
        return mismatch(out[:B], want, rel_max, f"the batch-{B} graph's logits",
                        "the eager step's")

    def size_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n (None: run eagerly)."""
        return next((B for B in self.sizes if B >= n and B in self.graphs), None)

    def run(self, seqs, prev: torch.Tensor | None = None) -> torch.Tensor | None:
        """seqs: [(token, position, slot, block table)] -> logits [n, V] FP32, or None when no
        graph fits (more sequences than the largest size, or a longer table). The logits are a
        view of the graph's output buffer, valid until the next run: the engine samples from
        them before its next step (a clone cost a launch and, at batch 64, 33 MB of copy).
        prev (given only when some token is a placeholder -1 - r of the overlapped step): the
        ids whose prev[r] replaces it, filled into the staged rows on the device (one launch)
        before the replay."""
        B = self.size_for(len(seqs))
        if B is None or any(len(s[3]) > self.nblk for s in seqs):
            return None
        self.copied.synchronize()                         # the previous copy has left self.host
        pad_decode_inputs(seqs, B, self.nblk, self.cache.scratch_slot, self.cache.scratch_block,
                          self.rows[:B])
        self.stage[:B].copy_(self.host[:B], non_blocking=True)     # pinned: truly async
        self.copied.record()
        if prev is not None:
            fill_placeholders_(self.stage[:len(seqs), 0], prev)
        g, out = self.graphs[B]
        g.replay()
        self.replays += 1
        return out[:len(seqs)]           # a view: valid until the next replay overwrites it
