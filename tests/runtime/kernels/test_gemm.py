"""Quantized-linear kernels (runtime.kernels.linear.gemm) against kernels.ref over a sweep of M, N,
K.

CPU: the Triton interpreter (TRITON_INTERPRET=1 while the module is imported). Its fp32->bf16
cast truncates instead of rounding to nearest, so interpreter tolerances are 1.5e-2 relative;
the same checks on a GPU (marker gpu) use 5e-3. Wrong scales, rows or K ranges give O(1) errors.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
TOL = 1.5e-2 if INTERPRET else 5e-3       # interpreter: truncating fp32->bf16 casts

import support  # noqa: E402

from backfit.quant import quantize_int8_groups
from backfit.runtime import kernels as kernels_pkg
from backfit.runtime import layers
from backfit.runtime.kernels import ref
from backfit.runtime.layers import Linear


def kernel_module():
    """runtime.kernels.linear.gemm, interpreted without CUDA: TRITON_INTERPRET must be set before
    triton is first imported (its own library is decorated then), so it is set at this module's
    import."""
    return support.kernel_module("linear.gemm", "_a16_kernel", INTERPRET)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def int8_weight(n: int, k: int, gen: torch.Generator):
    """Row-scaled weights (per-row magnitude spread, as real checkpoints) quantized int8_g128."""
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    q, s = quantize_int8_groups(w)
    return q.to(DEV), s.to(DEV)


def randn(*shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).bfloat16().to(DEV)


@pytest.fixture(scope="module")
def gemm():
    return kernel_module()


def test_act_quant_bit_exact_with_ties_and_zero_groups(gemm):
    gen = torch.Generator().manual_seed(1)
    for m, k in ((1, 128), (7, 384), (130, 256)):
        x = randn(m, k, gen=gen)
        x[0, :128] = 0                                              # all-zero group: scale 0
        x[-1, 120:128] = torch.tensor([127, 63.5, -0.5, 1.5, 2.5, -2.5, 3.5, 0.5])  # exact .5 ties
        q, s = gemm.act_quant(x)
        rq, rs = ref.act_quant_ref(x.cpu())       # CPU: torch CUDA divides by a scalar as x·(1/s)
        assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs), (m, k)
        assert (q[-1, 120:128] == torch.tensor([127, 64, 0, 2, 2, -2, 4, 0], device=DEV)).all()
    with pytest.raises(ValueError, match="K % 128"):
        gemm.act_quant(torch.zeros(2, 100, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("n,k", [(64, 256), (96, 384), (160, 128)])
def test_int8_decode_path_sweep(gemm, n, k):
    gen = torch.Generator().manual_seed(n + k)
    q, s = int8_weight(n, k, gen)
    for m in (1, 2, 7, 17, 33, 63, 127):
        x = randn(m, k, gen=gen)
        want = ref.linear_ref(x, q, s, "int8_g128")
        for split in (None, 1, 3):
            y = gemm.linear(x, q, s, "int8_g128", split_k=split)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert rel(y, want) < TOL, (m, n, k, split)


def test_int8_prefill_path_w8a8(gemm):
    gen = torch.Generator().manual_seed(3)
    for m, n, k in ((64, 64, 256), (65, 96, 128), (130, 160, 384)):
        q, s = int8_weight(n, k, gen)
        x = randn(1, m, k, gen=gen)                                  # leading dims kept
        y = gemm.linear(x, q, s, "int8_g128", path="w8a8" if m < gemm.PREFILL_M else None)
        assert y.shape == (1, m, n)
        assert rel(y, ref.linear_w8a8_ref(x, q, s)) < TOL            # same integers, FP32 scales
        assert rel(y, ref.linear_ref(x, q, s, "int8_g128")) < 3e-2   # + INT8 activation rounding


def test_bf16_and_copy_weights_any_m_and_odd_k(gemm):
    gen = torch.Generator().manual_seed(4)
    for m, n, k in ((1, 64, 200), (9, 48, 128), (64, 80, 96), (129, 64, 256)):
        w, x = randn(n, k, gen=gen), randn(m, k, gen=gen)
        for scheme in ("bf16", "copy"):
            assert rel(gemm.linear(x, w, None, scheme), ref.linear_ref(x, w, None, scheme)) < TOL


def test_bad_input_one_line_errors(gemm):
    q, s = int8_weight(64, 128, torch.Generator().manual_seed(5))
    x = randn(2, 128, gen=torch.Generator().manual_seed(5))
    for call, msg in ((lambda: gemm.linear(x.float(), q, s, "int8_g128"), "bfloat16"),
                      (lambda: gemm.linear(x[:, :64], q, s, "int8_g128"), "inputs"),
                      (lambda: gemm.linear(x, q, s[:, :0], "int8_g128"), "scales"),
                      (lambda: gemm.linear(x, q, None, "int8_mx32"), "not supported"),
                      (lambda: gemm.linear(x, q.bfloat16(), None, "bf16", path="w8a8"), "w8a8")):
        with pytest.raises(ValueError, match=msg):
            call()


def test_small_m_goes_to_gemv_only_at_table_shapes(gemm, monkeypatch):
    """linear() sends M <= 8 rows to kernels.linear.gemv where GEMV_TABLE lists the shape (an H200
    win), with the same result as the a16 path to FP32 summation order; other shapes, M > 8,
    explicit path/config and FP32 weights stay on a16."""
    from backfit.runtime.kernels.linear import gemv
    gen = torch.Generator().manual_seed(3)
    q, sc = int8_weight(96, 256, gen)
    entry = ("int8", (96, 96), (256, 256), (1, 4), dict(variant="cuda", BN=4, BK=128,
                                                         num_warps=4, MAGIC=True))
    monkeypatch.setattr(gemv, "GEMV_TABLE", [entry])
    calls = []
    real = gemv.launch                                  # linear's door into kernels.linear.gemv
    monkeypatch.setattr(gemv, "launch", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    x = randn(3, 256, gen=gen)
    for out_dtype in (torch.bfloat16, torch.float32):
        y = gemm.linear(x, q, sc, "int8_g128", out_dtype=out_dtype)
        assert calls[-1] == (3, 256) and y.dtype == out_dtype and y.shape == (3, 96)
        assert rel(y, gemm.linear(x, q, sc, "int8_g128", path="a16", out_dtype=out_dtype)) < TOL
    n = len(calls)
    gemm.linear(randn(5, 256, gen=gen), q, sc, "int8_g128")          # M = 5: not in the entry
    gemm.linear(x, q[:64].contiguous(), sc[:64].contiguous(), "int8_g128")   # another N
    gemm.linear(x, q, sc, "int8_g128", config=dict(BN=32))            # explicit tiles
    assert len(calls) == n


def test_backend_switch_set_once_default_torch(monkeypatch):
    monkeypatch.setattr(kernels_pkg, "_backend", None)
    assert kernels_pkg.get_kernel_backend() == "torch"
    with pytest.raises(ValueError, match="expected one of"):
        kernels_pkg.set_kernel_backend("cuda")
    kernels_pkg.set_kernel_backend("triton")
    kernels_pkg.set_kernel_backend("triton")                          # same value: fine
    assert kernels_pkg.get_kernel_backend() == "triton"
    with pytest.raises(RuntimeError, match="set once"):
        kernels_pkg.set_kernel_backend("torch")


def test_linear_dispatch_only_behind_the_switch(gemm, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    q, s = int8_weight(96, 256, gen)
    lin = Linear(256, 96)
    lin.load("int8_g128", q, s)
    x = randn(5, 256, gen=gen)
    plain = torch.nn.functional.linear(x, lin.dequantized(torch.bfloat16))
    assert kernels_pkg.get_kernel_backend() == "torch"
    assert torch.equal(lin(x), plain)                                 # switch off: torch path bits
    monkeypatch.setattr(layers, "get_kernel_backend", lambda: "triton")
    assert torch.equal(lin(x), gemm.linear(x, q, s, "int8_g128"))     # switch on: the kernel
    assert not torch.equal(lin(x), plain)
    xf = x.float()                                                    # FP32 input: torch path
    assert torch.equal(lin(xf), torch.nn.functional.linear(xf, lin.dequantized(torch.float32)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_linear_real_shapes_against_reference(gemm):
    gen = torch.Generator().manual_seed(7)
    for m, n, k in ((1, 1024, 4096), (8, 4096, 1024), (63, 512, 2048), (64, 1024, 4096),
                    (333, 768, 1024), (1024, 4096, 8192)):
        q, s = int8_weight(n, k, gen)
        x = randn(m, k, gen=gen)
        want = ref.linear_w8a8_ref(x, q, s) if m >= gemm.PREFILL_M \
            else ref.linear_ref(x, q, s, "int8_g128")
        assert rel(gemm.linear(x, q, s, "int8_g128"), want) < 5e-3, (m, n, k)
        wb = q.bfloat16()
        assert rel(gemm.linear(x, wb, None, "bf16"), ref.linear_ref(x, wb, None, "bf16")) < 5e-3
