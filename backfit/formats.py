"""The converted-directory contract shared by `convert` (writer) and `runtime` (reader).

docs/FORMAT.md describes it in prose. A converted directory holds:
  manifest.json                 this module's Manifest: format version, tp, per-tensor scheme ...
  config.json, tokenizer*.json  copied from the source
  rank{r}/model-XXXXX-of-NNNNN.safetensors   rank r's slice of every tensor of source shard X
  rank{r}/model.safetensors.index.json       weight_map of rank r
"""

from __future__ import annotations

import json
from pathlib import Path

from backfit.inventory import VISION_PREFIXES

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "SCHEMES", "INT8_GROUP", "MX_GROUP",
           "MX_EXP_BIAS", "rank_dir", "load_manifest", "FormatError", "shard_dim_for"]

FORMAT_NAME = "backfit-dsv4"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INT8_GROUP = 128     # int8_g128: one FP32 scale per (output row, 128 inputs)
MX_GROUP = 32        # int8_mx32: one exponent byte per (output row, 32 inputs)
MX_EXP_BIAS = 128    # int8_mx32 value = q * 2^(e - 128)  (q = 2 * e2m1, so bias 128 keeps e)

# scheme -> what the stored tensors mean (the weight is `X.weight`, its scale `X.scale`)
SCHEMES = {
    "int8_g128": "I8 weight [N, K] + F32 scale [N, K/128]; W = q * scale (re-quantized FP8, lossy)",
    "int8_mx32": "I8 weight [N, K] + U8 exponent [N, K/32]; W = q * 2^(e-128) (MXFP4, bit-exact)",
    "mx4_e2m1": "U8 packed e2m1 codes [N, K/2] (low nibble = input 2j) + U8 exponent [N, K/32]; "
                "W = e2m1 * 2^(e-127) (the MXFP4 source bytes, bit-exact)",
    "bf16": "BF16 weight [N, K]; exact dequantization of FP8 or MXFP4",
    "copy": "unchanged from the source (BF16, F32 or I64)",
}

# Tensor-parallel sharding plan (dsv4-model.md 6.3). Matched on the name's suffix; the MoE
# experts are split by intermediate dim (every rank holds 1/tp of every expert: balanced at
# batch 1) rather than 256/tp whole experts per rank.
_SHARD_RULES = (
    (("embed.weight", "head.weight"), 0),                       # vocab-parallel
    ((".attn.wq_b.weight", ".attn.wq_b.scale", ".attn.attn_sink",
      ".indexer.wq_b.weight", ".indexer.wq_b.scale", ".indexer.weights_proj.weight"), 0),  # by head
    ((".attn.wo_a.weight",), 0),                                # by output group
    ((".attn.wo_b.weight", ".attn.wo_b.scale"), 1),             # by input (row-parallel)
    ((".w1.weight", ".w1.scale", ".w3.weight", ".w3.scale"), 0),  # experts: intermediate rows
    ((".w2.weight", ".w2.scale"), 1),                           # experts: intermediate inputs
)


def shard_dim_for(name: str) -> int | None:
    """Dimension along which tensor `name` is split across ranks; None = replicated."""
    # The Vision-Exp tower, aligner and sentinels (dsv4-vision.md section 3) are replicated
    # (0.93 GB BF16 per rank, docs/FORMAT.md); their `w1`/`w2` are plain Linears that the expert
    # rules below must not split.
    if name.startswith(VISION_PREFIXES) or (name.startswith("mtp.") and ".markov_head." in name):
        return None
    for suffixes, dim in _SHARD_RULES:
        if name in suffixes or name.endswith(tuple(s for s in suffixes if s.startswith("."))):
            return dim
    return None


class FormatError(ValueError):
    """A converted directory is missing files or declares a format this code does not read."""


def rank_dir(root: str | Path, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def load_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{path}: not found (is {root} a converted directory?)") from None
    if m.get("format") != FORMAT_NAME or m.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{path}: format {m.get('format')} v{m.get('format_version')}, "
                          f"this backfit reads {FORMAT_NAME} v{FORMAT_VERSION}")
    return m
