"""Byte layout of the DeepSeek-V4 cache pools: ring rows, entry widths, bytes per slot and block.

Pure Python over a ModelConfig (docs/ENGINE.md section 2); the pools allocate their tensors from
these numbers and `backfit plan` (backfit/capacity.py) sizes them with the same ones. No torch.

Per layer, with D = head_dim, W = sliding_window, K = rollback tokens, B = block_size and
e = bytes of one stored D-wide vector (bf16: 2·D; int8: D + one FP32 scale; fp32: 4·D):

  slot (one per sequence, fixed size)         rows                  bytes
    window ring   [W + K, D]                  W + K                 (W + K)·e
    CSA compressor c, z  [2·4 + K, 2·D] FP32  entry j pools blocks   2·(8 + K)·2D·4
    CSA indexer compressor c, z [8 + K, 2·128] FP32   j-1 and j      2·(8 + K)·256·4
    HCA compressor c, z  [m + K, D] FP32      rows from m·(L//m) on  2·(m + K)·D·4
  block (B tokens of one sequence, all layers)
    CSA entries [B/4, D] + indexer keys [B/4, 128] (activation dtype)
    HCA entries [B/m, D]
Window-only layers (ratio 0) and MTP/DSpark draft layers hold only a window ring.

  snapshot (prefix caching: the state at a block boundary b that a continuation reads, §3)
    window rows of positions b-W+1 .. b-1      W - 1                 (W - 1)·e
    CSA compressor and indexer c, z            b-4 .. b-1            2·4·(2D + 256)·4
    HCA compressor                             none (b is a multiple of m)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from backfit.config import ModelConfig

__all__ = ["KV_DTYPES", "ACT_DTYPES", "ROLLBACK", "MIN_BLOCK", "LayerLayout", "CacheLayout",
           "cache_layout", "default_block_size", "vector_bytes", "boundary_rows"]

# --kv-cache-dtype -> (bytes per element, bytes of the per-vector scale)
KV_DTYPES = {"bf16": (2, 0), "int8": (1, 4), "fp32": (4, 0)}
ACT_DTYPES = {"bf16": 2, "fp32": 4}      # indexer keys are stored in the activation dtype
ROLLBACK = 8                             # speculative decoding rolls back at most 8 tokens
ROW_BYTES = 4                            # compressor rolling rows (c and z) are FP32
MIN_BLOCK = 64                           # default blocks hold at least 64 tokens (tiny: 64)


def vector_bytes(width: int, kv_dtype: str) -> int:
    """Bytes of one stored `width`-wide vector: elements plus its scale (int8: FP32 absmax/127)."""
    elem, scale = KV_DTYPES[kv_dtype]
    return width * elem + scale


def boundary_rows(ratio: int) -> int:
    """Compressor rows a continuation from a block boundary b reads (b is a multiple of every
    ratio): CSA (coff 2) entry b/4 pools blocks b/4 - 1 and b/4, so rows b-4 .. b-1; HCA (coff 1)
    entry b/m pools b .. b+m-1 only, so none; window-only layers have no compressor."""
    return ratio if ratio == 4 else 0


@dataclass(frozen=True)
class LayerLayout:
    """One layer's share of a slot and of a block. Row counts are ring sizes (pos mod rows)."""
    layer: int              # main layer index; num_hidden_layers + s for draft stage s
    ratio: int              # 0 window only, 4 CSA, m >= 8 HCA
    window_rows: int        # W + K
    entry_bytes: int        # one stored D-wide vector (window rows and compressed entries)
    comp_rows: int = 0      # compressor c/z ring: 2·4 + K (CSA), m + K (HCA), 0
    comp_width: int = 0     # 2·D (CSA: overlapping windows), D (HCA)
    index_rows: int = 0     # CSA indexer compressor ring: 2·4 + K
    index_width: int = 0    # 2·index_head_dim
    key_bytes: int = 0      # one indexer key: index_head_dim · activation bytes (CSA)
    entries_per_block: int = 0   # B / ratio

    @property
    def kind(self) -> str:
        return "window" if self.ratio == 0 else "csa" if self.ratio == 4 else "hca"

    @property
    def window_bytes(self) -> int:
        return self.window_rows * self.entry_bytes

    @property
    def rows_bytes(self) -> int:
        """FP32 c and z rows of the attention compressor and (CSA) the indexer compressor."""
        rows = self.comp_rows * self.comp_width + self.index_rows * self.index_width
        return 2 * ROW_BYTES * rows

    @property
    def slot_bytes(self) -> int:
        return self.window_bytes + self.rows_bytes

    @property
    def block_bytes(self) -> int:
        return self.entries_per_block * (self.entry_bytes + self.key_bytes)

    def snapshot_bytes(self, window: int) -> int:
        """This layer's share of a prefix-cache snapshot: window - 1 window rows and the
        boundary rows of its compressors (FP32 c and z)."""
        rows = boundary_rows(self.ratio) * (self.comp_width + self.index_width)
        return (window - 1) * self.entry_bytes + 2 * ROW_BYTES * rows


@dataclass(frozen=True)
class CacheLayout:
    """Every layer's layout plus the pool-level totals the allocator and the planner use."""
    layers: tuple[LayerLayout, ...]
    block_size: int
    kv_dtype: str
    act_dtype: str
    rollback: int
    head_dim: int
    index_head_dim: int
    window: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every layer's window ring and compressor rows."""
        return sum(lay.slot_bytes for lay in self.layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of `block_size` tokens across all layers (entries + indexer keys)."""
        return sum(lay.block_bytes for lay in self.layers)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one prefix-cache snapshot (docs/ENGINE.md §3): the state at a block boundary
        that a continuation reads, every layer's (drafter layers included)."""
        return sum(lay.snapshot_bytes(self.window) for lay in self.layers)

    @property
    def kv_bytes_per_token(self) -> float:
        """Growing cache per token: block_bytes / block_size (exact; a fraction for int8 HCA)."""
        return self.block_bytes / self.block_size

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of `length` tokens holds: ceil(length / block_size)."""
        return -(-length // self.block_size)

    def sequence_bytes(self, length: int) -> int:
        """One sequence of `length` tokens: its slot plus its blocks."""
        return self.slot_bytes + self.blocks_for(length) * self.block_bytes

    def count(self, kind: str) -> int:
        return sum(lay.kind == kind for lay in self.layers)


def default_block_size(cfg: ModelConfig) -> int:
    """The smallest multiple of every compression ratio that is >= MIN_BLOCK (Flash: 128)."""
    step = reduce(math.lcm, {r for r in cfg.compress_ratios if r}, 1)
    return step * max(1, -(-MIN_BLOCK // step))


def _layer(cfg: ModelConfig, layer: int, ratio: int, B: int, K: int, kv_dtype: str,
           act_dtype: str) -> LayerLayout:
    D = cfg.head_dim
    base = dict(layer=layer, ratio=ratio, window_rows=cfg.sliding_window + K,
                entry_bytes=vector_bytes(D, kv_dtype))
    if ratio == 0:
        return LayerLayout(**base)
    if ratio == 4:
        # overlapped compressor (coff 2): entry j pools blocks j-1 and j, so after a rollback to L'
        # rows from 4·(L'//4 - 1) on must survive: 2·4 rows plus the K rolled-back ones
        rows, IHD = 2 * ratio + K, cfg.index_head_dim
        return LayerLayout(**base, comp_rows=rows, comp_width=2 * D, index_rows=rows,
                           index_width=2 * IHD, key_bytes=IHD * ACT_DTYPES[act_dtype],
                           entries_per_block=B // ratio)
    # HCA (coff 1): rows from m·(L'//m) on, i.e. at most m - 1 pending rows plus K
    return LayerLayout(**base, comp_rows=ratio + K, comp_width=D, entries_per_block=B // ratio)


def cache_layout(cfg: ModelConfig, kv_dtype: str = "bf16", block_size: int | None = None,
                 rollback: int = ROLLBACK, act_dtype: str = "bf16",
                 draft_layers: int = 0) -> CacheLayout:
    """The pools' layout for `cfg`. block_size defaults to default_block_size (Flash 128, tiny
    64); draft_layers adds window-only rings for MTP / DSpark stages (with speculative decoding)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv cache dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"activation dtype {act_dtype!r}: choose one of {', '.join(ACT_DTYPES)}")
    if rollback < 0:
        raise ValueError(f"rollback must be >= 0 tokens, got {rollback}")
    if not 0 <= draft_layers <= cfg.num_mtp_stages:
        raise ValueError(f"draft_layers {draft_layers}: the model has {cfg.num_mtp_stages} "
                         f"draft stage(s)")
    ratios = sorted({cfg.ratio(i) for i in range(cfg.num_hidden_layers)} - {0})
    lcm = reduce(math.lcm, ratios, 1)
    B = default_block_size(cfg) if block_size is None else block_size
    if B <= 0 or B % lcm:
        raise ValueError(f"block_size {B} must be a positive multiple of every compression ratio "
                         f"({', '.join(map(str, ratios))}): e.g. {lcm}")
    layers = [_layer(cfg, i, cfg.ratio(i), B, rollback, kv_dtype, act_dtype)
              for i in range(cfg.num_hidden_layers)]
    layers += [_layer(cfg, cfg.num_hidden_layers + s, 0, B, rollback, kv_dtype, act_dtype)
               for s in range(draft_layers)]
    return CacheLayout(tuple(layers), B, kv_dtype, act_dtype, rollback, cfg.head_dim,
                       cfg.index_head_dim, cfg.sliding_window)
