"""The vision side of a synthetic DeepSeek-V4-Flash-Vision-Exp checkpoint (dsv4-vision.md s1-s3).

`backfit.synthetic` writes the 0731 text architecture underneath and asks this module for the
config keys and for every tensor `inventory.is_vision_tensor` names: the ViT (patch embedding,
pre-norm blocks with fused wqkv and SwiGLU w1 = [gate | up]), its final norm, the aligner
(Linear(9D -> H) + GELU + Linear(H -> H)), the four LM-space sentinels and `ffn.gate.bias_vl`.
Dimensions are scaled down; what the format and the preprocessing depend on is kept: patch 14,
the 3x3 fold, the sentinels, `vision_max_n_token` 384 and the real resize limits.

Weights are drawn like the text side (`synthetic._Weights`, passed in as `w`): Student-t rows, a
residual that each block changes by a trained-like share, and an aligner whose output lives in
the LM stream subspace at the embedding rows' magnitude, so an image row looks to the LM like a
(strong) token embedding rather than noise of another scale.
"""

from __future__ import annotations

import torch

__all__ = ["REAL_VISION", "TINY_VISION", "vision_keys", "draw_vision"]

# the published Vision-Exp values (dsv4-vision.md section 2), in config.json order
REAL_VISION = dict(
    vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
    vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3,
    vision_max_n_token=384, vision_min_pixels=147456, vision_max_wh_ratio=8,
)
# tiny: 2 blocks of width 128 (4 heads x 32: 8 RoPE frequencies per axis), SwiGLU 352 (the real
# 2816/1024 ratio); the preprocessing constants stay the real ones (section 6 tables hold)
TINY_VISION = dict(REAL_VISION, vision_n_layers=2, vision_dim=128, vision_n_heads=4,
                   vision_inter_dim=352)

PATCH_GAIN = 2.0          # patches are ~0.5 RMS (pixels in [-1, 1]): the stream starts ~1 RMS
BLOCK_OUT_GAIN = 0.15     # wo and w2: each block changes a trained-like share of the residual
ALIGNER_OUT_GAIN = 3.0    # image rows at ~1.25x the embedding rows' RMS (docs/SYNTHETIC.md)
BIAS_STD = 0.02           # the Linear biases of tower and aligner
ROUTER_BIAS = 0.12        # bias_vl: drawn like the text bias (synthetic.ROUTER_BIAS), independently


def vision_keys(**overrides) -> dict:
    """The 10 `vision_*` config keys of the tiny checkpoint (overrides: any of them)."""
    bad = set(overrides) - set(TINY_VISION)
    if bad:
        raise ValueError(f"unknown vision key(s) {sorted(bad)}")
    return {**TINY_VISION, **overrides}


def draw_vision(w, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One vision-side tensor (float32; the caller casts to the on-disk dtype) by its name."""
    H, leaf = w.c.hidden_size, name.rsplit(".", 1)[-1]
    if name.endswith(".gate.bias_vl"):
        return ROUTER_BIAS * w.randn(*shape)
    if name.startswith("image_"):                     # sentinels: like an embedding row
        return w.embedding(1)[0]
    if "norm" in name:                                # RMSNorm gains around 1
        return torch.exp(0.2 * w.randn(*shape))
    if leaf == "bias":
        return BIAS_STD * w.randn(*shape)
    n, k = shape
    if name == "aligner.w2.weight":                   # writes the LM stream: columns in S
        return w.linear(n, k, gain=ALIGNER_OUT_GAIN, outlier_rows=0.0, writes=True)
    if name == "vision.patch_embed.proj.weight":
        return w.heavy(n, k, gain=PATCH_GAIN, outlier_rows=0.0)
    # no 6x outlier rows in the tower: in SwiGLU an outlier gate row times an outlier up row
    # would be a 36x feature, and the blocks would rewrite the stream instead of updating it
    if name.endswith((".attn.wo.weight", ".mlp.w2.weight")):
        return w.heavy(n, k, gain=BLOCK_OUT_GAIN, outlier_rows=0.0)
    if name.endswith((".attn.wqkv.weight", ".mlp.w1.weight")) or name == "aligner.w1.weight":
        return w.heavy(n, k, gain=1.0, outlier_rows=0.0)
    raise KeyError(f"synthetic generator has no rule for {name} (H = {H})")
