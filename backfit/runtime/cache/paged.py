"""PagedCache: the engine's cache pools, allocated once; docs/ENGINE.md §1-§2 is the design.

Per layer (l < num_hidden_layers; then one window-only layer per MTP stage):
  ring      [S, W+K, D]          latent KV of the last W+K positions, row = pos % (W+K)
  rows      [S, R, width] x2     FP32 compressor c, z, row = pos % R  (R = 2*4+K CSA, m+K HCA)
  entries   [NB, B/m, D]         compressed entry j of a sequence: block table[j // (B/m)],
                                 row j % (B/m)
  index     rows [S, 16, 256] x2 and keys [NB, B/4, 128]   (CSA layers: the indexer's)
S = slots (running sequences), NB = blocks of B tokens, plus one scratch
slot and one scratch block that no sequence owns: the padded rows of a CUDA-graph decode batch
and the branchless decode writes of entries that are not complete yet land there. Rings are sized
so the last K = ROLLBACK tokens can be recomputed differently (speculative decoding) with
nothing to undo: rolling back is re-running from an earlier start.
kv_dtype "int8" stores the window and the compressed entries as INT8 with one FP32 scale per
D-vector (symmetric, round to nearest), dequantized on read; indexer keys and rows never are.
Prefix-cache snapshots (the boundary state of a slot, docs/ENGINE.md §3) live beside the slots in
`snapshots` (runtime/cache/snapshot.py).
"""

from __future__ import annotations

import math

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch, to_device
from backfit.runtime.cache.snapshot import SnapshotPool

__all__ = ["ROLLBACK", "PagedCache", "ring_rows", "check_block_size"]

ROLLBACK = 8            # tokens a sequence can roll back (docs/ENGINE.md §1)


def ring_rows(cfg: ModelConfig, ratio: int) -> tuple[int, int]:
    """(window ring rows, compressor ring rows) of a layer with this compression ratio."""
    comp = 0 if ratio == 0 else (2 * 4 if ratio == 4 else ratio) + ROLLBACK
    return cfg.sliding_window + ROLLBACK, comp


def check_block_size(cfg: ModelConfig, block_size: int) -> None:
    ratios = [r for r in cfg.compress_ratios if r]
    step = math.lcm(*ratios) if ratios else 1
    if block_size <= 0 or block_size % step:
        raise ValueError(f"block size {block_size} must be a positive multiple of {step} "
                         f"(the compression ratios {sorted(set(ratios))})")


def _kernels(x: torch.Tensor) -> bool:
    """The decode stores run as one Triton launch (kernels.cache.decode) on the triton backend."""
    from backfit.runtime.kernels import kernel_path
    return kernel_path(x)


class _Store:
    """[N, rows, width] vectors in the storage dtype (+ [N, rows] FP32 scales for int8)."""

    def __init__(self, n: int, rows: int, width: int, dtype: torch.dtype, int8: bool, device):
        self.dtype, self.int8 = dtype, int8
        self.data = torch.zeros(n, rows, width, dtype=torch.int8 if int8 else dtype, device=device)
        self.scale = torch.ones(n, rows, dtype=torch.float32, device=device) if int8 else None

    def put(self, idx: tuple, x: torch.Tensor) -> None:
        if self.int8:                                   # per-vector symmetric, |q| <= 127
            s = x.float().abs().amax(-1).clamp_min(1e-30) / 127
            self.data[idx] = torch.round(x.float() / s[:, None]).to(torch.int8)
            self.scale[idx] = s
        else:
            self.data[idx] = x.to(self.dtype)

    def get(self, idx: tuple) -> torch.Tensor:
        if self.int8:
            return (self.data[idx].float() * self.scale[idx][..., None]).to(self.dtype)
        return self.data[idx]

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (self.scale.numel() * 4 if self.scale is not None else 0)


class _Compressed:
    """One compressor's rings (per slot) and entry blocks (per block)."""

    def __init__(self, ratio, width, entry_dim, slots, blocks, block_size, rows, dtype, int8, dev):
        self.ratio, self.rows_n, self.per_block = ratio, rows, block_size // ratio
        self.c = torch.zeros(slots, rows, width, dtype=torch.float32, device=dev)
        self.z = torch.zeros(slots, rows, width, dtype=torch.float32, device=dev)
        self.entries = _Store(blocks, self.per_block, entry_dim, dtype, int8, dev)


class _LayerPool:
    def __init__(self, cfg: ModelConfig, ratio: int, slots: int, blocks: int, block_size: int,
                 dtype: torch.dtype, int8: bool, device):
        D, W = cfg.head_dim, cfg.sliding_window
        self.W = W
        ring, rows = ring_rows(cfg, ratio)
        self.ring = _Store(slots, ring, D, dtype, int8, device)
        self.comp = self.index = None
        if ratio:
            width = (2 if ratio == 4 else 1) * D
            self.comp = _Compressed(ratio, width, D, slots, blocks, block_size, rows, dtype,
                                    int8, device)
        if ratio == 4:                                    # keys stay in the act dtype
            self.index = _Compressed(4, 2 * cfg.index_head_dim, cfg.index_head_dim, slots,
                                     blocks, block_size, rows, dtype, False, device)

    def parts(self):
        return [p for p in (self.comp, self.index) if p is not None]


class _PagedLayer:
    """One layer's pools bound to a batch: the runtime/state.py layer-cache interface."""

    def __init__(self, pool: _LayerPool, slots: list[int], tables: list[torch.Tensor],
                 bound: "_BoundPaged | None" = None):
        self.pool, self.slots, self.tables, self.bound = pool, slots, tables, bound

    # Device views for the Triton decode kernels (kernels.attention.decode,
    # kernels.attention.indexer): the pools
    # themselves, no copies. Stores are (data [N, rows, D], FP32 scale [N, rows] or None).
    def ring_pool(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.pool.ring.data, self.pool.ring.scale

    def entry_pool(self, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self._part(kind).entries
        return e.data, e.scale

    @property
    def multi_row(self) -> bool:
        """Rows of this decode batch may share a slot (_BoundPaged.multi_row)."""
        return self.bound.multi_row

    def slot_ids(self) -> torch.Tensor:
        """[B] int32 slots of the batch's sequences, on the pools' device."""
        return self.bound.device_tables()[0]

    def block_table(self) -> torch.Tensor:
        """[B, max blocks] int32 block tables on the pools' device, padded with block 0."""
        return self.bound.device_tables()[1]

    @property
    def scratch_block(self) -> int:
        """The block no sequence owns: decode writes of incomplete entries go there."""
        return self.bound.cache.scratch_block

    # Decode (one token per sequence, positions pos [B] on the device): batched and branchless, so
    # the step has no host sync and can be captured in a CUDA graph (Compressor.decode_update).
    def write_rows_tokens(self, kind: str, pos: torch.Tensor, c: torch.Tensor,
                          z: torch.Tensor) -> None:
        """Sequence b's compressor rows c[b], z[b] [width] at position pos[b]."""
        p, s = self._part(kind), self.slot_ids().long()
        r = pos % p.rows_n
        p.c[s, r], p.z[s, r] = c, z

    def rows_tokens(self, kind: str, pos: torch.Tensor, n: int):
        """c, z [B, n, width] of positions pos[b]-n+1 .. pos[b] (rows of positions < 0: stale)."""
        p, s = self._part(kind), self.slot_ids().long()
        r = (pos[:, None] - torch.arange(n - 1, -1, -1, device=pos.device)) % p.rows_n
        return p.c[s[:, None], r], p.z[s[:, None], r]

    def write_entries_tokens(self, kind: str, pos: torch.Tensor, E: torch.Tensor) -> None:
        """Entry j = pos[b] // m := E[b] [D] where that block completes ((pos+1) % m == 0); the
        other rows write the scratch block instead."""
        p, tables = self._part(kind), self.block_table()
        if _kernels(E):
            from backfit.runtime.kernels.cache import store_decode
            store_decode(E, pos, p.entries.data, p.entries.scale, tables=tables, ratio=p.ratio,
                         scratch=self.scratch_block)
            return
        j, done = pos // p.ratio, (pos + 1) % p.ratio == 0
        col = torch.where(done, j // p.per_block, 0).clamp_max(tables.shape[1] - 1)
        blk = tables.gather(1, col[:, None].long())[:, 0].long()
        blk = torch.where(done, blk, self.scratch_block)
        p.entries.put((blk, j % p.per_block), E)

    def rows_pool(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressor rings c, z [S, R, width] FP32 themselves (kernels.cache.decode)."""
        p = self._part(kind)
        return p.c, p.z

    def write_window_tokens(self, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """Decode: sequence i's one token pos[i], kv[i] into its ring (= write_window per i)."""
        ring = self.pool.ring
        if _kernels(kv):
            from backfit.runtime.kernels.cache import store_decode
            store_decode(kv, pos, ring.data, ring.scale, slots=self.slot_ids())
            return
        ring.put((self.slot_ids().long(), pos % ring.data.shape[1]), kv)

    def write_window_rows(self, slots: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """kv [n, D] of positions pos [n] into the rings of slots [n] (a drafter row rewrite)."""
        ring = self.pool.ring
        ring.put((slots, pos % ring.data.shape[1]), kv)

    def window(self, i: int, start: int):
        ring = self.pool.ring
        prev = torch.arange(max(0, start - self.pool.W + 1), start, device=ring.data.device)
        return ring.get((self.slots[i], prev % ring.data.shape[1])), prev

    def ring_positions(self, i: int, lo: int, hi: int):
        """Sequence i's ring rows of positions lo .. hi-1 (hi - lo <= W + K, all written) ->
        (kv [hi - lo, D] in the act dtype, positions): a drafter's context (DSpark's stages)."""
        ring = self.pool.ring
        pos = torch.arange(lo, hi, device=ring.data.device)
        return ring.get((self.slots[i], pos % ring.data.shape[1])), pos

    def write_window(self, i: int, pos: torch.Tensor, kv: torch.Tensor) -> None:
        R = self.pool.ring.data.shape[1]
        keep = min(pos.shape[0], R)                       # older rows of a long chunk: gone
        self.pool.ring.put((self.slots[i], pos[-keep:] % R), kv[-keep:])

    # Prefill / mixed batches on the kernel path (Compressor.prefill_update, Attention._kernels):
    # every sequence's chunk at once, from row lists built once a batch on the host.
    def entry_rows(self, kind: str) -> torch.Tensor:
        """int32 [K]: the batch rows whose position completes a block of `kind`'s entries."""
        p = self._part(kind)
        return self.bound.entry_rows(p.ratio, p.per_block)

    def chunk_rows(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, positions, slots) int32 [K] of each sequence's last min(n, R) rows: what a
        ring of R rows keeps of the batch (one writer a ring row)."""
        return self.bound.chunk_rows(R)

    def write_window_chunk(self, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """write_window for every sequence of the batch: kv [T, D] (kernel path: one gather,
        one store launch; else per sequence)."""
        ring = self.pool.ring
        if not _kernels(kv):
            for s in self.bound.batch.slices():
                self.write_window(s.index, pos[s.lo:s.hi], kv[s.lo:s.hi])
            return
        from backfit.runtime.kernels.cache import store_decode
        rows, rpos, rslots = self.chunk_rows(ring.data.shape[1])
        store_decode(kv.index_select(0, rows), rpos, ring.data, ring.scale, slots=rslots)

    def _part(self, kind: str) -> _Compressed:
        return self.pool.comp if kind == "comp" else self.pool.index

    def rows(self, i: int, kind: str, lo: int, start: int):
        p = self._part(kind)
        r = torch.arange(lo, start, device=p.c.device) % p.rows_n
        return p.c[self.slots[i], r], p.z[self.slots[i], r]

    def write_rows(self, i, kind, pos, c, z, keep_from: int) -> None:
        p = self._part(kind)
        keep = min(pos.shape[0], p.rows_n)                # the ring keeps what rollback needs
        r = pos[-keep:] % p.rows_n
        p.c[self.slots[i], r], p.z[self.slots[i], r] = c[-keep:], z[-keep:]

    def _where(self, i: int, p: _Compressed, j0: int, j1: int, device):
        """(block, row in block) of entries j0 .. j1-1 of sequence i; checked on the host."""
        table = self.tables[i]
        if j1 > j0 and (j1 - 1) // p.per_block >= table.shape[0]:
            raise IndexError(f"entry {j1 - 1} needs block {(j1 - 1) // p.per_block} of a "
                             f"sequence with {table.shape[0]} blocks")
        j = torch.arange(j0, j1, device=device)
        return table[j // p.per_block], j % p.per_block

    def write_entries(self, i, kind, j0: int, E: torch.Tensor) -> None:
        p = self._part(kind)
        p.entries.put(self._where(i, p, j0, j0 + E.shape[0], E.device), E)

    def entries(self, i, kind, n: int) -> torch.Tensor:
        p = self._part(kind)
        return p.entries.get(self._where(i, p, 0, n, p.c.device))


class _BoundPaged:
    def __init__(self, cache: "PagedCache", batch: ForwardBatch | None,
                 device_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                 multi_row: bool = False):
        """Bound to a batch's host slots and tables, or (batch None) to device tensors: slots [B]
        int32 and tables [B, nblk] int32 (a CUDA-graph decode step: the kernel path only).
        multi_row: a decode-shaped batch whose rows may share a slot at consecutive positions
        (a verify step's rows, runtime/graphs/spec.py): the decode path then stores each row's
        ring and compressor rows before any row reads them."""
        self.cache, self._device, self.multi_row = cache, device_tables, multi_row
        if batch is None:
            self.slots = self.tables = self._host_tables = self.batch = None
            return
        if batch.slots is None or batch.block_tables is None:
            raise ValueError("a PagedCache batch needs slots and block tables")
        self.slots = list(batch.slots)
        self.tables = [to_device(t, torch.int64, cache.device) for t in batch.block_tables]
        self._host_tables = batch.block_tables
        self.batch, self._rows = batch, {}          # the row lists of the prefill kernels

    def bind(self, batch: ForwardBatch) -> "_BoundPaged":
        """An already bound cache binds to itself (Transformer.hidden calls bind)."""
        return self

    def device_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B] int32, block tables [B, max blocks] int32 padded with 0), built once."""
        if self._device is None:
            n = max(1, max(len(t) for t in self._host_tables))      # host tuples: no sync
            rows = [list(t) + [0] * (n - len(t)) for t in self._host_tables]
            self._device = (to_device(self.slots, torch.int32, self.cache.device),
                            to_device(rows, torch.int32, self.cache.device))
        return self._device

    def chunk_rows(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_PagedLayer.chunk_rows, built once per R (host lists, one copy; no sync)."""
        if ("ring", R) not in self._rows:
            rows, rpos, rslots = [], [], []
            for s in self.batch.slices():
                keep = range(max(s.lo, s.hi - R), s.hi)
                rows += keep
                rpos += (s.start + t - s.lo for t in keep)
                rslots += [self.slots[s.index]] * len(keep)
            both = to_device([rows, rpos, rslots], torch.int32, self.cache.device)
            self._rows["ring", R] = (both[0], both[1], both[2])
        return self._rows["ring", R]

    def entry_rows(self, m: int, per_block: int) -> torch.Tensor:
        """_PagedLayer.entry_rows, built once per m; a block table too short for an entry is
        the torch path's IndexError."""
        if ("entry", m) not in self._rows:
            rows = []
            for s in self.batch.slices():
                table = self._host_tables[s.index]
                j0, j1 = s.start // m, (s.start + s.n) // m
                if j1 > j0 and (j1 - 1) // per_block >= len(table):
                    raise IndexError(f"entry {j1 - 1} needs block {(j1 - 1) // per_block} of "
                                     f"a sequence with {len(table)} blocks")
                rows += (s.lo + (j + 1) * m - 1 - s.start for j in range(j0, j1))
            self._rows["entry", m] = to_device(rows, torch.int32, self.cache.device)
        return self._rows["entry", m]

    def layer(self, l: int) -> _PagedLayer:
        return _PagedLayer(self.cache.layers[l], self.slots, self.tables, self)

    def commit(self) -> None:                             # lengths live in the engine
        pass


class PagedCache:
    """All layers' pools: num_slots fixed-size states, num_blocks blocks of block_size tokens."""

    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, kv_dtype: str = "auto", device="cpu", mtp_layers: int = 0,
                 num_snapshots: int = 0):
        check_block_size(cfg, block_size)
        if kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv cache dtype {kv_dtype!r}: choose auto (= activations) or int8")
        self.cfg, self.block_size, self.num_slots, self.num_blocks = cfg, block_size, num_slots, num_blocks
        self.dtype, self.kv_dtype, self.device = dtype, kv_dtype, torch.device(device)
        self.scratch_slot, self.scratch_block = num_slots, num_blocks     # owned by no sequence
        ratios = [cfg.ratio(i) for i in range(cfg.num_hidden_layers)] + [0] * mtp_layers
        self.layers = [_LayerPool(cfg, r, num_slots + 1, num_blocks + 1, block_size, dtype,
                                  kv_dtype == "int8", self.device) for r in ratios]
        self.snapshots = SnapshotPool(self, num_snapshots)

    def bind(self, batch: ForwardBatch) -> _BoundPaged:
        return _BoundPaged(self, batch)

    def bind_device(self, slots: torch.Tensor, tables: torch.Tensor,
                    multi_row: bool = False) -> _BoundPaged:
        """Bound to device slots [B] int32 and tables [B, nblk] int32 (graph decode steps;
        multi_row: rows may share a slot, _BoundPaged)."""
        return _BoundPaged(self, None, (slots, tables), multi_row)

    def store_ring(self, layer: int, slots: torch.Tensor, pos: torch.Tensor,
                   kv: torch.Tensor) -> None:
        """kv [T, D] into layer's window ring at (slots[t], pos[t] % rows), device tensors, one
        launch on the kernel path (no host sync: CUDA-graph safe). The (slot, position) pairs
        must be distinct modulo the ring (a drafter's context: at most its rows per slot)."""
        ring = self.layers[layer].ring
        if _kernels(kv):
            from backfit.runtime.kernels.cache import store_decode
            store_decode(kv, pos, ring.data, ring.scale, slots=slots.int())
            return
        ring.put((slots.long(), pos % ring.data.shape[1]), kv)

    def ring_rows(self, layer: int, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """layer's ring rows at (slots[...], pos[...] % rows), any index shape -> [..., D] in the
        act dtype (dequantized); positions must still be in the ring."""
        ring = self.layers[layer].ring
        return ring.get((slots.long(), pos % ring.data.shape[1]))

    def nbytes(self) -> dict[str, int]:
        """Bytes of the pools: {'slots': num_slots slots, 'blocks': num_blocks blocks,
        'snapshots': the snapshot pool}; the scratch slot and block (one of each) come on top."""
        slots = blocks = 0
        for lp in self.layers:
            slots += lp.ring.nbytes()
            for p in lp.parts():
                slots += (p.c.numel() + p.z.numel()) * 4
                blocks += p.entries.nbytes()
        return {"slots": slots * self.num_slots // (self.num_slots + 1),
                "blocks": blocks * self.num_blocks // (self.num_blocks + 1),
                "snapshots": self.snapshots.nbytes()}
