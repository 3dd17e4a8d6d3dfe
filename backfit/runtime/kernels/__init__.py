"""Triton kernels for the GPU fast path, grouped by operation, and the process-wide switch that
selects them. Each room exposes the launchers the model calls through its __init__.

  linear/     quantized linears: gemm (a16 / w8a8 launcher `linear`), gemv (small-M decode GEMVs,
              the RMSNorm folded in, the grouped einsum), gemv_tiles (their measured table)
  moe/        the fused MoE: common (alignment, tiles, launch sequence, expert stacks), int8 and
              mx4 sorted kernels, their decode GEMVs (int8_decode, mx4_decode)
  attention/  sparse attention over the paged pools: decode, prefill (+ prefill_cd, tiles), and
              the lightning indexer's scores and top-k
  mhc/        mHC hc_pre / hc_post / hc_head: core, decode (fused pairs), tile (prefill)
  cache/      the compressors' pooling and the ring / entry stores: decode and prefill
  router.py   the MoE router (GEMV + top-k) in one launch at decode
  pointwise.py  small per-token kernels: SwiGLU, top-k route, MoE combine, embedding, placeholders
  rope_norm.py  RMSNorm and RoPE, one launch each
  common.py   what every room shares (the BF16 dot, interpreter check, SM count)
  ref.py      plain-torch references with the runtime torch path's math (tests, fallback)

The switch is read by runtime.layers, runtime.cache.paged and runtime.model.* (attention,
compressor, moe, hyper). It defaults to "torch" and is set once per process, so the torch path
stays bit-for-bit what it was unless a caller opts in. Importing this package does not import
triton (the kernel rooms do, on first use).
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
