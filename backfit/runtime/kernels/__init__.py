"""Triton kernels for the GPU fast path, and the process-wide switch that selects them.

  kernels.gemm   quantized linear: int8_g128 (W8A16 decode, W8A8 prefill) and bf16/copy weights
  kernels.moe    fused MoE for stacked int8_mx32 experts (gate+up+SwiGLU, down with routing weight)
  kernels.mhc    mHC hc_pre / hc_post / hc_head (FP32 logits + Sinkhorn, 2 / 1 / 2 launches)
  kernels.ref    plain-torch references with the runtime's torch-path math (tests, fallback)

The switch is read by runtime.layers (Linear, ParallelHead), runtime.model.moe.MoE and
runtime.model.hyper (mHC). It defaults to "torch" and is set once per process, so the torch path
stays bit-for-bit what it was unless a caller opts in. Importing this package does not import triton (gemm/moe/mhc do, on first use).
"""

from __future__ import annotations

__all__ = ["KERNEL_BACKENDS", "set_kernel_backend", "get_kernel_backend"]

KERNEL_BACKENDS = ("torch", "triton")
_backend: str | None = None


def set_kernel_backend(name: str) -> None:
    """Select "torch" or "triton" for this process; a second call with another value raises."""
    global _backend
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend {name!r}: expected one of {KERNEL_BACKENDS}")
    if _backend is not None and _backend != name:
        raise RuntimeError(f"kernel backend already set to {_backend!r} (set once per process)")
    _backend = name


def get_kernel_backend() -> str:
    """The selected backend; "torch" when nothing was set (never raises)."""
    return _backend or "torch"
