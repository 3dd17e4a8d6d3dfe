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


def split_k_check(fused_moe, st, gen, ref_fn, variant: str, dev: str, tol: float,
                  bk: int = 64) -> None:
    """A decode variant with split-K (config SPLIT) through fused_moe at T = 1..3 against the
    torch math ref_fn: SPLIT 2 and 4 of gate/up's K = D (parts of D / SPLIT inputs in BK tiles;
    the down projection's K = I fits fewer splits, launch_decode's fit_split), the current
    stream's counters back at 0 after each launch (the next launch and a graph replay count
    from 0), and the same bits from a second launch."""
    from backfit.runtime.streams import stream_counters
    D, E, k = st[0].shape[2] * (2 if st[0].dtype == torch.uint8 else 1), st[0].shape[0], 3
    for T, split in ((1, 2), (2, 4), (3, 4)):
        x = (torch.randn(T, D, generator=gen) * 4).bfloat16().to(dev)
        idx, w = routing(T, k, E, gen, dev)
        cfg = dict(variant=variant, BN=16, BK=bk, num_warps=2, SPLIT=split)
        y = fused_moe(x, idx, w, *st, LIMIT, path="decode", config=cfg)
        assert not stream_counters(x.device, 1).any(), (variant, split)
        assert rel(y, ref_fn(x, idx, w, *st, LIMIT)) < tol, (variant, T, split)
        assert torch.equal(y, fused_moe(x, idx, w, *st, LIMIT, path="decode", config=cfg))


def split_args(st, gen, dev: str) -> tuple:
    """(x, idx, w) of one token for stacks st (3 of its experts)."""
    D = st[0].shape[2] * (2 if st[0].dtype == torch.uint8 else 1)
    return ((torch.randn(1, D, generator=gen)).bfloat16().to(dev),
            *routing(1, 3, st[0].shape[0], gen, dev))


def down_combine_check(fused_moe, common, st, gen, dev: str) -> None:
    """The combine inside the down launch (common.DOWN_COMBINE) gives moe_combine's bits: T = 1
    and 3 tokens, with and without the shared expert's output, FP32 and BF16 sums; the current
    stream's counters back at 0 after each launch."""
    from backfit.runtime.streams import stream_counters
    D, E = st[4].shape[1], st[0].shape[0]
    K = st[0].shape[2] * (2 if st[0].dtype == torch.uint8 else 1)
    for T, with_shared, dtype in ((1, True, torch.float32), (3, True, torch.bfloat16),
                                  (3, False, torch.float32)):
        x = (torch.randn(T, K, generator=gen) * 4).bfloat16().to(dev)
        idx, w = routing(T, 3, E, gen, dev)
        sh = (torch.randn(T, D, generator=gen) * 8).bfloat16().to(dev) if with_shared else None
        got = fused_moe(x, idx, w, *st, LIMIT, path="decode", shared=sh, dtype=dtype)
        assert not stream_counters(x.device, 1).any()
        old, common.DOWN_COMBINE = common.DOWN_COMBINE, False
        try:
            want = fused_moe(x, idx, w, *st, LIMIT, path="decode", shared=sh, dtype=dtype)
        finally:
            common.DOWN_COMBINE = old
        assert got.dtype == dtype and torch.equal(got, want), (T, with_shared, dtype)
