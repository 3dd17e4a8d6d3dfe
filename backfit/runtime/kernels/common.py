"""Helpers every kernel room shares: the BF16 dot with its interpreter fallback, whether Triton
runs interpreted, the SM count that sizes persistent and split-K grids, and the int8 -> FP32
magic constants of the CUDA-core GEMVs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAGIC_F", "MAGIC_I", "dot_bf16", "interpreted", "num_sms"]

# An int8 code q to FP32 without I2F (16/clk/SM on sm_80): bits(1.5·2^23) + q is the float
# 1.5·2^23 + q for |q| < 2^22, and minus 1.5·2^23 it is q, exactly (linear.gemv_fma and
# moe.int8_decode)
MAGIC_I = tl.constexpr(0x4B400000)             # bits of 1.5·2^23
MAGIC_F = tl.constexpr(12582912.0)             # 1.5·2^23


@triton.jit
def dot_bf16(a, b, acc, F32: tl.constexpr):
    """acc + a @ b for BF16 operands with FP32 accumulation. F32 (interpreter only): Triton 3.9's
    interpreter mis-multiplies BF16 dots, so operands go up to FP32 there (same exact products)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(dot_bf16, triton.runtime.jit.JITFunction)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 4 under the interpreter (small grids)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
