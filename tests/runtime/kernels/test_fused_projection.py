"""FusedProjection (runtime.layers): Linears of one input as one kernel launch.

The members' weights become row views of the fused weight (no memory added, each member still
works alone), the fused outputs equal each member's own kernel output (to FP32 summation order:
the split-K factor depends on N), FP32 output equals forward_f32; mismatched schemes or FP32
weights are not fused. CPU: the Triton interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from backfit.quant import quantize_int8_groups  # noqa: E402
from backfit.runtime.layers import FusedProjection, Linear  # noqa: E402


def _lin(n, k, scheme, g):
    m = Linear(k, n)
    w = torch.randn(n, k, generator=g) * 0.05
    if scheme == "int8_g128":
        q, s = quantize_int8_groups(w)
        m.load(scheme, q.to(DEV), s.to(DEV))
    else:
        m.load(scheme, w.to(torch.bfloat16).to(DEV))
    return m


@pytest.mark.parametrize("scheme", ["int8_g128", "copy"])
def test_fused_equals_members(scheme, monkeypatch):
    from backfit.runtime import kernels as kpkg
    from backfit.runtime.kernels.linear import gemm
    monkeypatch.setattr(kpkg, "_backend", "triton")
    monkeypatch.setattr("backfit.runtime.layers._on_gpu", lambda x: True)    # interpreter
    g = torch.Generator().manual_seed(1)
    ms = [_lin(n, 256, scheme, g) for n in (64, 192, 32)]
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16).to(DEV)
    alone = [gemm.linear(x, m.weight, m.scale, scheme) for m in ms]
    alone32 = [m.forward_f32(x) for m in ms]
    f = FusedProjection.fuse(ms)
    assert f is not None and f.sizes == [64, 192, 32] and f.weight.shape == (288, 256)
    for m in ms:                                            # members are views of the fused one
        assert m.weight.untyped_storage().data_ptr() == f.weight.untyped_storage().data_ptr()
    for got, want in zip(f(x), alone):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    for got, want in zip(f(x, torch.float32), alone32):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert f.joint(x).shape == (3, 288)


def test_not_fused_when_schemes_differ():
    g = torch.Generator().manual_seed(2)
    assert FusedProjection.fuse([_lin(64, 256, "int8_g128", g), _lin(64, 256, "copy", g)]) is None
    m = Linear(256, 64)
    m.load("copy", torch.randn(64, 256).to(DEV))            # FP32 weight: the kernel would round
    assert FusedProjection.fuse([m, _lin(64, 256, "copy", g)]) is None
    assert FusedProjection.fuse([_lin(64, 256, "copy", g)]) is None   # one member: nothing to do
