"""Drafters for speculative decoding, built on the decoder blocks (runtime.model.block); they
import the blocks, never the main tower.

  mtp   Flash's MTP block `mtp.0` (dsv4-model.md 5.8)
"""
