"""Drafters for speculative decoding (dsv4-model.md 5.8-5.9, shared/docs/spec-decoding.md),
built on the decoder blocks (runtime.model.block); they never import the main tower.

  mtp     Flash's MTP block `mtp.0`, chained for k > 1 on its own pre-hc_head output
  dspark  0731's three DSpark stages `mtp.0..2`: taps, per-stage rings, the non-causal 5-row
          block and the Markov-corrected head
  common  DraftRows (who drafts a step) and pick (a row's draft token and its q)

Both keep their state in the PagedCache's drafter layers (layer num_hidden_layers + s, a window
ring of W + K rows per slot, keyed by position): the runner calls `context` over every row of
every forward (filling the rings from what the target computed) and `draft` at the start of a
speculative step (the k tokens to verify). Drafter state lives in slots, never in batch rows.
Both take device tensors only, so a CUDA graph captures them (runtime/graphs/spec.py).
"""

from __future__ import annotations

from torch import nn

from backfit.config import ModelConfig
from backfit.runtime.model.draft.common import Draft, DraftRows, pick

__all__ = ["Draft", "DraftRows", "build_drafter", "drafter_for", "pick"]


def build_drafter(cfg: ModelConfig) -> nn.ModuleList:
    """The checkpoint's drafter blocks, named as its `mtp.*` tensors (empty when it has none)."""
    if not cfg.num_mtp_stages:
        return nn.ModuleList()
    if cfg.variant == "flash":
        from backfit.runtime.model.draft.mtp import MTPBlock
        return nn.ModuleList(MTPBlock(cfg) for _ in range(cfg.num_mtp_stages))
    from backfit.runtime.model.draft.dspark import DSparkStage
    n = cfg.num_mtp_stages
    return nn.ModuleList(DSparkStage(cfg, first=i == 0, last=i == n - 1) for i in range(n))


def drafter_for(model, cache):
    """The drafter over `model`'s drafter blocks and `cache` (a PagedCache with its drafter
    layers): MTPDrafter (Flash) or DSparkDrafter (0731)."""
    if not len(model.mtp):
        raise ValueError("this model was built without its drafter blocks (mtp=False)")
    if model.cfg.variant == "flash":
        from backfit.runtime.model.draft.mtp import MTPDrafter
        return MTPDrafter(model, cache)
    from backfit.runtime.model.draft.dspark import DSparkDrafter
    return DSparkDrafter(model, cache)
