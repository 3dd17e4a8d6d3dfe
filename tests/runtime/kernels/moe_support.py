"""Helpers of the fused-MoE kernel tests (test_moe.py: int8_mx32 experts, test_moe_mx4.py:
mx4_e2m1 experts): the kernel modules for the interpreter or the GPU, expert stacks, routing,
the error measure and the no-host-sync check."""

from __future__ import annotations

import importlib

import torch

LIMIT = 10.0                                  # the SwiGLU clamp of every test
_CHAIN = ("common", "moe.common", "moe.int8_decode", "moe.int8", "moe.mx4_decode", "moe.mx4",
          "moe")                                                          # import order


def moe_kernels(interpret: bool):
    """(the kernels.moe package, kernels.moe.mx4), re-imported in dependency order when their
    Triton kernels were decorated for the other mode (TRITON_INTERPRET is read at decoration).
    The package's fused_moe dispatches on the stacks; its modules: .common, .int8, .mx4."""
    mods = [importlib.import_module(f"backfit.runtime.kernels.{n}") for n in _CHAIN]
    if mods[0].interpreted() != interpret:
        mods = [importlib.reload(m) for m in mods]
    return mods[-1], mods[-2]


def stacks(weight, E: int, D: int, I: int, seed: int, up: tuple[int, int]):
    """(w1, s1, w3, s3, w2, s2) of E experts, hidden D, intermediate I, from weight(e, n, k, gen
    [, lo, hi]); up: w3's exponent range, larger, so that some |u| > LIMIT gets clamped."""
    gen = torch.Generator().manual_seed(seed)
    w1, s1 = weight(E, I, D, gen)
    w3, s3 = weight(E, I, D, gen, *up)
    w2, s2 = weight(E, D, I, gen)
    return (w1, s1, w3, s3, w2, s2), gen


def routing(T: int, k: int, E: int, gen: torch.Generator, dev: str):
    """k distinct experts per token and their routing weights."""
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
    return idx, torch.rand(T, k, generator=gen).to(dev)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def without_host_sync(fn):
    """fn() once to compile, then again with CUDA's sync debug mode raising on any host sync."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
