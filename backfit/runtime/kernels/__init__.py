"""Triton kernels for the GPU fast path, and the process-wide switch that selects them.

  kernels.gemm       quantized linear: int8_g128 (W8A16 decode, W8A8 prefill), bf16/copy weights,
                     BF16 or FP32 output (head, router, compressors)
  kernels.moe        fused MoE for stacked int8_mx32 experts (gate+up+SwiGLU, down with routing
                     weight; the sorted tensor-core path; decode GEMV variants in moe_decode)
  kernels.gemv       small-M (decode) GEMV for the linears, where its table says it beats gemm's
  kernels.moe_mx4    the same for 4-bit mx4_e2m1 experts (e2m1 decoded in registers); its decode
                     GEMV variants in kernels.moe_mx4_decode
  kernels.attention  sparse attention over the paged pools (decode and chunked prefill)
  kernels.attention_prefill  the query-blocked kernel the chunked prefill runs on
  kernels.indexer    lightning-indexer scores and top-k over the paged indexer keys
  kernels.mhc        mHC hc_pre / hc_post / hc_head (FP32 logits + Sinkhorn, 2 / 1 / 2 launches)
  kernels.rope_norm  RMSNorm and RoPE, one launch each (RoPE bit-equal to the torch path)
  kernels.cache_ops  the compressors' decode update and the ring / entry stores of a decode step
  kernels.cache_prefill  the same update for every sequence of a prefill / mixed batch at once
  kernels.pointwise  the router's top-k, the shared expert's SwiGLU, the MoE's top-k + shared sum
  kernels.ref        plain-torch references with the runtime's torch-path math (tests, fallback)

The switch is read by runtime.layers, runtime.cache.paged and runtime.model.* (attention,
compressor, moe, hyper). It defaults to "torch" and is set once per process, so the torch path
stays bit-for-bit what it was unless a caller opts in. Importing this package does not import
triton (the kernel modules do, on first use).
"""

from __future__ import annotations

__all__ = ["KERNEL_BACKENDS", "set_kernel_backend", "get_kernel_backend", "kernel_path"]

KERNEL_BACKENDS = ("torch", "triton")
_backend: str | None = None
_ANY_DEVICE = False      # tests: let CPU tensors take the kernel path (under TRITON_INTERPRET)


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


def kernel_path(x) -> bool:
    """Whether `x` takes the Triton kernels: the triton backend is on and x is a CUDA tensor
    (or any tensor while _ANY_DEVICE is set: the interpreter's end-to-end test)."""
    return _backend == "triton" and (x.is_cuda or _ANY_DEVICE)
