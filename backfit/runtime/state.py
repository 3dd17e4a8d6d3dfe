"""Per-sequence incremental decoding state (plain tensors, one sequence at a time).

Per layer (dsv4-model.md 5.4.10, 5.4.6):
  ring      [window, D]   latent KV (K = V) of the last `window` positions, slot = pos % window
  comp      compressed KV entries [n, D] of a CSA/HCA layer + the compressor's rolling rows
  index     the indexer's compressed keys [n, 128] + its compressor's rolling rows (CSA only)
Rolling rows are the FP32 (c, z) projections of the tokens not yet pooled: the incomplete block,
and for CSA (overlapping windows) also the previous complete block, whose first halves feed the
next entry. The model's MTP block, when present, owns one extra window-only layer state.
Paged GPU pools (kv_cache.py) come later; this is the plain-torch reference layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backfit.config import ModelConfig

__all__ = ["CompressorState", "LayerState", "SequenceState", "DecodeState"]


@dataclass
class CompressorState:
    width: int                    # coff * head_dim: columns of the (c, z) rows
    head_dim: int                 # width of one pooled entry
    dtype: torch.dtype
    device: torch.device
    base: int = 0                 # absolute position of rolling row 0 (a block start)
    c: torch.Tensor = None        # [r, width] fp32, positions base .. base+r-1
    z: torch.Tensor = None        # [r, width] fp32 gate logits (ape already added)
    entries: torch.Tensor = None  # [n, head_dim] pooled, normed, rotated entries (act dtype)

    def __post_init__(self):
        empty = torch.empty(0, self.width, dtype=torch.float32, device=self.device)
        self.c, self.z = empty, empty.clone()
        self.entries = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)


@dataclass
class LayerState:
    ring: torch.Tensor                       # [window, D] act dtype
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

    def free(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs
