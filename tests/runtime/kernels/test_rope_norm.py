"""RMSNorm and RoPE kernels (runtime.kernels.rope_norm) against the torch path (runtime.layers).

CPU: the Triton interpreter. RoPE is held bit-exact in FP32 (the interpreter's FP32 -> BF16 cast
truncates, so BF16 there gets one BF16 ulp; on a GPU, marker gpu, BF16 is exact too). RMSNorm's
tree reduction differs from torch's order: FP32 rounding noise, i.e. ~1e-6 relative, checked
at 2e-6 in FP32 and one BF16 ulp in BF16. Shapes: the real ones (hidden 4096, q_lora 1024,
head 512 with rope 64, indexer 128 with rope 64) and small ragged ones.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402

from backfit.runtime.layers import RMSNorm, Rotary  # noqa: E402


def kmod():
    return kernel_module("rope_norm", "_rms_kernel", INTERPRET)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in BF16 steps between two BF16 tensors of one sign pattern."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("shape, rope_dim, theta, scaling", [
    ((5, 3, 512), 64, 10000.0, None),
    ((2, 64, 512), 64, 160000.0, dict(factor=16, original_max_position_embeddings=65536,
                                      beta_fast=32, beta_slow=1)),
    ((7, 512), 64, 10000.0, None),
    ((3, 4, 128), 64, 160000.0, None),
    ((4, 2, 16), 8, 10000.0, None),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_rotary(shape, rope_dim, theta, scaling, dtype):
    m = kmod()
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype).to(DEV)
    pos = torch.randint(0, 1 << 20, (shape[0],), generator=g).to(DEV)
    pos[0] = 0
    rot = Rotary(rope_dim, theta, scaling).to(DEV)
    for inverse in (False, True):
        want = rot(x, pos, inverse=inverse)
        got = m.rope(x, pos, rot.inv_freq, rope_dim, inverse)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert torch.equal(got[..., :-rope_dim], x[..., :-rope_dim])
        if dtype == torch.float32 or not INTERPRET:
            assert torch.equal(got, want), (inverse, (got - want).abs().max())
        else:
            assert _bf16_ulps(got, want) <= 1


@pytest.mark.parametrize("shape, weighted", [((3, 4, 512), False), ((5, 512), True),
                                             ((2, 3, 128), True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_norm_equals_norm_then_rope(shape, weighted, dtype):
    """rope(x, norm=(w, eps)) = Rotary(RMSNorm(x)) in one launch (the attention's q and kv)."""
    m = kmod()
    g = torch.Generator().manual_seed(sum(shape) + weighted)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)
    pos = torch.randint(0, 1 << 16, (shape[0],), generator=g).to(DEV)
    rot = Rotary(64, 10000.0, None).to(DEV)
    norm = RMSNorm(shape[-1], 1e-6).to(DEV)
    norm.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
    if weighted:
        normed = norm(x)
    else:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(dtype)
    want = rot(normed, pos)
    got = m.rope(x, pos, rot.inv_freq, 64, norm=(norm.weight if weighted else None, 1e-6))
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)
    else:    # the norm's FP32 rounding (and the interpreter's truncating casts): BF16 steps
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    wide = torch.cat([x, x], dim=-1)[..., :shape[-1]]          # strided rows, as fused views
    assert not wide.is_contiguous() and torch.equal(
        m.rope(wide, pos, rot.inv_freq, 64, norm=(norm.weight if weighted else None, 1e-6)), got)
    with pytest.raises(ValueError, match="norm weight must be FP32"):
        m.rope(x, pos, rot.inv_freq, 64, norm=(torch.ones(3, device=DEV), 1e-6))


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_inplace_equals_rope(inverse):
    """rope(x, inplace=True) rotates x's last R lanes in place, bit for bit as rope(x), and never
    touches the rest (the prefill output's inverse RoPE: o stored in bf16, then this)."""
    m = kmod()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, 512, generator=g).bfloat16().to(DEV)
    pos = torch.randint(0, 1 << 16, (5,), generator=g).to(DEV)
    rot = Rotary(64, 10000.0, None).to(DEV)
    want = m.rope(x, pos, rot.inv_freq, 64, inverse)
    head = x[..., :-64].clone()
    y = x.clone()
    got = m.rope(y, pos, rot.inv_freq, 64, inverse, inplace=True)
    assert got.data_ptr() == y.data_ptr() and torch.equal(got, want)
    assert torch.equal(y[..., :-64], head) and not torch.equal(y[..., -64:], x[..., -64:])
    with pytest.raises(ValueError, match="inplace"):
        m.rope(y, pos, rot.inv_freq, 64, norm=(None, 1e-6), inplace=True)
    with pytest.raises(ValueError, match="inplace"):
        m.rope(torch.zeros(5, 6, 512, dtype=torch.bfloat16, device=DEV)[:, ::2], pos,
               rot.inv_freq, 64, inplace=True)                           # not contiguous


def test_rope_rounds_fp32_input_to_out_dtype():
    """rope(o FP32, out_dtype=bf16) = Rotary(o.to(bf16)): the attention output's inverse RoPE."""
    m = kmod()
    g = torch.Generator().manual_seed(5)
    o = torch.randn(3, 4, 512, generator=g).to(DEV)
    pos = torch.randint(0, 1 << 16, (3,), generator=g).to(DEV)
    rot = Rotary(64, 10000.0, None).to(DEV)
    want = rot(o.to(torch.bfloat16), pos, inverse=True)
    got = m.rope(o, pos, rot.inv_freq, 64, inverse=True, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    if INTERPRET:                                        # truncating FP32 -> BF16 casts
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows, n", [(1, 4096), (3, 1024), (130, 512), (5, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_equals_rmsnorm(rows, n, dtype, weighted):
    m = kmod()
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(DEV)
    norm = RMSNorm(n, 1e-6).to(DEV)
    norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
    if weighted:
        want = norm(x)
    else:
        xf = x.float()
        want = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = m.rms_norm(x, norm.weight if weighted else None, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        assert _bf16_ulps(got, want) <= 1


def test_rms_norm_strided_rows_and_bad_weight():
    m = kmod()
    x = torch.randn(4, 3, 256).to(DEV)[:, 1]                  # rows with stride 768
    want = m.rms_norm(x.contiguous(), None, 1e-6)
    assert torch.equal(m.rms_norm(x, None, 1e-6), want)
    with pytest.raises(ValueError, match="weight must be FP32"):
        m.rms_norm(x, torch.ones(256, dtype=torch.bfloat16, device=DEV), 1e-6)
