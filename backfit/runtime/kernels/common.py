"""Helpers every kernel room shares: the BF16 dot with its interpreter fallback, whether Triton
runs interpreted, and the SM count that sizes persistent and split-K grids."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dot_bf16", "interpreted", "num_sms"]


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
