"""Prefix-cache snapshots: the part of a slot that a continuation from a block boundary reads
(docs/ENGINE.md §3), in a pool of its own beside PagedCache's slots.

Snapshot n of boundary b (a multiple of the block size, so of every compression ratio), per layer
of the PagedCache (main layers, then drafter layers):
  window  [N, W-1, D] in the ring's storage (+ [N, W-1] FP32 scales for int8): row j holds
          position b - (W-1) + j, i.e. positions b-W+1 .. b-1
  rows    per compressor with boundary rows (CSA attention and indexer: layout.boundary_rows = 4)
          c, z [N, 4, width] FP32: positions b-4 .. b-1
HCA compressors keep nothing (entry b/m pools positions b .. b+m-1 only), and no rollback row is
kept (nothing below a shared boundary is ever rolled back). save and restore copy the stored
values, int8 data with their scales, so a restore is exact. Where b < W - 1 the rows of negative
positions are copied too: ring rows that a continuation writes before it reads them.
"""

from __future__ import annotations

import torch

from backfit.runtime.cache.layout import boundary_rows

__all__ = ["SnapshotPool"]


class _LayerSnap:
    """One layer's snapshots: (slot tensor, snapshot tensor, boundary rows) copy pairs."""

    def __init__(self, pool, n: int, window_rows: int):
        ring = pool.ring
        dev = ring.data.device
        self.pairs = [(ring.data, torch.zeros(n, window_rows, ring.data.shape[2],
                                              dtype=ring.data.dtype, device=dev), window_rows)]
        if ring.scale is not None:
            self.pairs.append((ring.scale, torch.ones(n, window_rows, device=dev), window_rows))
        for part in pool.parts():
            r = boundary_rows(part.ratio)
            if r:
                for t in (part.c, part.z):
                    self.pairs.append((t, torch.zeros(n, r, t.shape[2], dtype=t.dtype,
                                                      device=dev), r))


class SnapshotPool:
    """num_snapshots snapshots of every layer of `cache` (a PagedCache)."""

    def __init__(self, cache, num_snapshots: int):
        self.num_snapshots = num_snapshots
        W = cache.cfg.sliding_window
        self.layers = [_LayerSnap(lp, num_snapshots, W - 1) for lp in cache.layers]
        self.device = cache.device

    def _rows(self, t: torch.Tensor, n: int, boundary: int) -> torch.Tensor:
        """The rows of positions boundary-n .. boundary-1 in a ring of t.shape[1] rows."""
        return torch.arange(boundary - n, boundary, device=self.device) % t.shape[1]

    @torch.no_grad()
    def save(self, slot: int, snap: int, boundary: int) -> None:
        """Snapshot `snap` := slot `slot`'s state at length `boundary`."""
        self._check(snap, boundary)
        for lay in self.layers:
            for src, dst, n in lay.pairs:
                dst[snap] = src[slot, self._rows(src, n, boundary)]

    @torch.no_grad()
    def restore(self, snap: int, slot: int, boundary: int) -> None:
        """Slot `slot` := snapshot `snap` (taken at `boundary`): the rows a continuation from
        `boundary` reads; the slot's other rows are written before they are read."""
        self._check(snap, boundary)
        for lay in self.layers:
            for dst, src, n in lay.pairs:
                dst[slot, self._rows(dst, n, boundary)] = src[snap]

    def _check(self, snap: int, boundary: int) -> None:
        if not 0 <= snap < self.num_snapshots:
            raise IndexError(f"snapshot {snap} of a pool of {self.num_snapshots}")
        if boundary <= 0:
            raise ValueError(f"a snapshot is taken at a block boundary > 0, got {boundary}")

    def nbytes(self) -> int:
        return sum(dst.numel() * dst.element_size() for lay in self.layers
                   for _, dst, _ in lay.pairs)
