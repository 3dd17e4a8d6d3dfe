"""Fake-quant (quantize -> dequantize) points of DeepSeek-V4's QAT, dsv4-model.md section 4.5.

All rounding goes through backfit.quant's exact encoders/decoders (round-to-nearest-even on the
code grid, lookup-table decode); no torch float8/float4 dtype is ever created. Every helper works
on the LAST dim in blocks, computes in float32 and returns the input dtype (the round-tripped
values are e4m3/e2m1 codes times a power of two, so they are exact in bfloat16 too).
"""

from __future__ import annotations

import torch

from backfit.quant import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    e8m0_pow2_scale,
    encode_e2m1,
    encode_e4m3,
)

__all__ = ["FP4_MAX", "FP8_MAX", "act_quant", "fake_fp4", "fake_fp8", "indexer_fake_fp4",
           "kv_fake_fp8"]

FP8_MAX = 448.0                 # largest finite e4m3fn
FP4_MAX = 6.0                   # largest e2m1
FP8_AMAX_FLOOR = 1e-4           # reference act_quant: amax.clamp_min(1e-4)
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126   # reference fp4_act_quant: smallest scale is 2^-126


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax/qmax)) as float32 (the UE8M0 value the reference kernels use)."""
    return decode_e8m0(e8m0_pow2_scale(amax, qmax)).to(amax.device)


def fake_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> e4m3 round trip per `block` channels, power-of-two scale (K % block == 0)."""
    xb = x.float().unflatten(-1, (-1, block))                              # [..., K/b, b]
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    s = _pow2_scale(amax, FP8_MAX)                                         # [..., K/b, 1]
    q = decode_e4m3(encode_e4m3((xb / s).clamp(-FP8_MAX, FP8_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


def fake_fp4(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> e2m1 round trip per `block` channels with a power-of-two scale."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_AMAX_FLOOR)
    s = _pow2_scale(amax, FP4_MAX)
    q = decode_e2m1(encode_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


def act_quant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Input of every FP8/FP4 linear (section 4.5 item 1): per token, per 128 input channels."""
    return fake_fp8(x, block)


def kv_fake_fp8(kv: torch.Tensor, rope_dim: int, block: int = 64) -> torch.Tensor:
    """Window / compressed KV (item 2): leading non-RoPE dims in 64-wide blocks; RoPE dims kept."""
    nope = kv.shape[-1] - rope_dim
    return torch.cat([fake_fp8(kv[..., :nope], block), kv[..., nope:]], dim=-1)


def indexer_fake_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer q / compressed key after the Hadamard rotation (item 3): FP4 in blocks of 32."""
    return fake_fp4(x, block)
