"""The cache interface the model computes against, and DecodeState: its plain per-sequence form.

Attention and the compressors only compute; every read and write of decoding state goes through
a *layer cache* bound to one batch (i = a sequence's index in the batch, positions absolute):

  window(i, start)                   -> keys [m, D], kpos [m]: latent KV of positions
                                        max(0, start-W+1) .. start-1 (what chunk i still sees)
  write_window(i, pos [n], kv [n, D])   after the chunk has read its window
  rows(i, kind, lo, start)           -> c, z [start-lo, width] FP32 rolling compressor rows
  write_rows(i, kind, pos, c, z, keep_from)  keep_from = first position a later chunk reads
  write_entries(i, kind, j0, E [k, w])       compressed entries j0 .. j0+k-1
  entries(i, kind, n)                -> [n, w] entries 0 .. n-1 (act dtype)
kind is "comp" (the layer's compressor) or "index" (the CSA indexer's). A cache's bind(batch)
gives .layer(l) (l < num_hidden_layers: main layers; then one window-only layer per MTP stage)
and .commit() (called once the forward is done).

DecodeState (here) keeps each sequence in its own growing tensors: it is the simple reference
layout that the engine's paged pools (runtime/cache/paged.py) must reproduce exactly. Rolling
rows are the FP32 (c, z) projections not yet pooled (dsv4-model.md 5.4.5-5.4.6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backfit.config import ModelConfig
from backfit.runtime.batch import ForwardBatch

__all__ = ["CompressorState", "LayerState", "SequenceState", "DecodeState"]


@dataclass
class CompressorState:
    width: int                    # coff * head_dim: columns of the (c, z) rows
    head_dim: int                 # width of one pooled entry
    dtype: torch.dtype
    device: torch.device
    base: int = 0                 # absolute position of rolling row 0
    c: torch.Tensor = None        # [r, width] fp32, positions base .. base+r-1
    z: torch.Tensor = None        # [r, width] fp32 gate logits (ape already added)
    entries: torch.Tensor = None  # [n, head_dim] pooled, normed, rotated entries (act dtype)

    def __post_init__(self):
        empty = torch.empty(0, self.width, dtype=torch.float32, device=self.device)
        self.c, self.z = empty, empty.clone()
        self.entries = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)


@dataclass
class LayerState:
    ring: torch.Tensor                       # [window, D] act dtype, slot = pos % window
    comp: CompressorState | None = None      # ratio != 0
    index: CompressorState | None = None     # ratio == 4


@dataclass
class SequenceState:
    layers: list[LayerState]
    length: int = 0               # tokens already processed (= next position)
    mtp: list[LayerState] = field(default_factory=list)


def _layer_state(cfg: ModelConfig, ratio: int, dtype, device) -> LayerState:
    D = cfg.head_dim
    st = LayerState(torch.zeros(cfg.sliding_window, D, dtype=dtype, device=device))
    if ratio:
        coff = 2 if ratio == 4 else 1             # CSA pools overlapping windows: 2x wide rows
        st.comp = CompressorState(coff * D, D, dtype, torch.device(device))
    if ratio == 4:
        st.index = CompressorState(2 * cfg.index_head_dim, cfg.index_head_dim, dtype,
                                   torch.device(device))
    return st


class _StateLayer:
    """One layer of DecodeState bound to a batch: states[i] is batch sequence i's LayerState."""

    def __init__(self, states: list[LayerState], window: int):
        self.states, self.W = states, window

    def window(self, i: int, start: int):
        prev = torch.arange(max(0, start - self.W + 1), start, device=self.states[i].ring.device)
        return self.states[i].ring[prev % self.W], prev

    def write_window(self, i: int, pos: torch.Tensor, kv: torch.Tensor) -> None:
        keep = min(pos.shape[0], self.W)                  # the ring keeps the newest W
        self.states[i].ring[pos[-keep:] % self.W] = kv[-keep:]

    def _comp(self, i: int, kind: str) -> CompressorState:
        return self.states[i].comp if kind == "comp" else self.states[i].index

    def rows(self, i: int, kind: str, lo: int, start: int):
        st = self._comp(i, kind)
        if st.base > lo or st.base + st.c.shape[0] != start:
            raise ValueError(f"compressor rows cover {st.base}..{st.base + st.c.shape[0]}, "
                             f"chunk needs {lo}..{start}")
        return st.c[lo - st.base:], st.z[lo - st.base:]

    def write_rows(self, i, kind, pos, c, z, keep_from: int) -> None:
        st = self._comp(i, kind)
        rows_c, rows_z = torch.cat((st.c, c)), torch.cat((st.z, z))   # positions base .. end-1
        keep = max(keep_from, st.base)
        st.c, st.z, st.base = rows_c[keep - st.base:], rows_z[keep - st.base:], keep

    def write_entries(self, i, kind, j0: int, E: torch.Tensor) -> None:
        st = self._comp(i, kind)
        if j0 != st.entries.shape[0]:
            raise ValueError(f"entry {j0} written after {st.entries.shape[0]} entries")
        st.entries = torch.cat((st.entries, E.to(st.dtype)))

    def entries(self, i, kind, n: int) -> torch.Tensor:
        return self._comp(i, kind).entries[:n]


class _BoundState:
    def __init__(self, state: "DecodeState", seqs: list[SequenceState], batch: ForwardBatch,
                 advance: bool):
        self.state, self.seqs, self.batch, self.advance = state, seqs, batch, advance

    def layer(self, l: int) -> _StateLayer:
        L = self.state.cfg.num_hidden_layers
        states = [s.layers[l] if l < L else s.mtp[l - L] for s in self.seqs]
        return _StateLayer(states, self.state.cfg.sliding_window)

    def commit(self) -> None:
        if self.advance:
            for s, n in zip(self.seqs, self.batch.seq_lens):
                s.length += n


class DecodeState:
    """seq_id -> SequenceState for the sequences currently being decoded."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", mtp_layers: int = 0):
        self.cfg, self.dtype, self.device, self.mtp_layers = cfg, dtype, torch.device(device), mtp_layers
        self.seqs: dict[int, SequenceState] = {}

    def new_sequence(self, seq_id: int) -> SequenceState:
        if seq_id in self.seqs:
            raise KeyError(f"sequence {seq_id} already has a state")
        cfg = self.cfg
        layers = [_layer_state(cfg, cfg.ratio(i), self.dtype, self.device)
                  for i in range(cfg.num_hidden_layers)]
        mtp = [_layer_state(cfg, 0, self.dtype, self.device) for _ in range(self.mtp_layers)]
        self.seqs[seq_id] = s = SequenceState(layers, 0, mtp)
        return s

    def get(self, seq_id: int, start: int) -> SequenceState:
        """The state of seq_id, created at start 0; raises unless `start` continues it exactly."""
        s = self.seqs.get(seq_id)
        if s is None:
            if start != 0:
                raise KeyError(f"sequence {seq_id} has no state but the batch starts at {start}")
            s = self.new_sequence(seq_id)
        if s.length != start:
            raise ValueError(f"sequence {seq_id} has {s.length} tokens cached, batch starts at {start}")
        return s

    def bind(self, batch: ForwardBatch, advance: bool = True) -> _BoundState:
        """The batch's view; advance=False (the MTP block) reuses existing states as they are."""
        if advance:
            seqs = [self.get(s.seq_id, s.start) for s in batch.slices()]
        else:
            seqs = [self.seqs[s.seq_id] for s in batch.slices()]
        return _BoundState(self, seqs, batch, advance)

    def free(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs
