"""mHC decode on the GPU (marker gpu) against an FP64 reference: post and M of the next hc_pre
from the partials that hc_post(next_fn=) computes beside its output, at each of its d blocks.
hc_pre's own partials and the post_mix kernel before `c4fc533` stay within 1.5-2.3e-7 of FP64
on an H100; the shipped post_mix gives 1.2-3.2e-5 at T > 1 with d blocks <= 64 (2026-12-07,
this check's computation run as a probe; the test itself has not run on a GPU yet), which this
test names (docs/KERNELS.md "Open"). Under the interpreter the same check holds (run
`check(dec, bd, Ts)` by hand: its FP32 ops are not the GPU's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import kernel_module

sys.path.insert(0, str(Path(__file__).parent))
from test_mhc import DEV, HC_EPS, INTERPRET, ITERS, NORM_EPS, S, params, rel_max, streams


def ref_post_m_fp64(Y, fn, scale, base):
    """hyper.hc_pre's post and M in FP64 from the streams Y as stored (hyper itself computes
    in FP32 whatever its inputs' dtype, so its math is restated here)."""
    x = Y.double().cpu().flatten(1)
    fn, scale, base = fn.double().cpu(), scale.double().cpu(), base.double().cpu()
    m = (x @ fn.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)
    post = 2 * torch.sigmoid(m[:, S:2 * S] * scale[1] + base[S:2 * S])
    M = torch.softmax((m[:, 2 * S:] * scale[2] + base[2 * S:]).view(-1, S, S), -1) + HC_EPS
    M = M / (M.sum(-2, keepdim=True) + HC_EPS)
    for _ in range(ITERS - 1):
        M = M / (M.sum(-1, keepdim=True) + HC_EPS)
        M = M / (M.sum(-2, keepdim=True) + HC_EPS)
    return post, M


def check(dec, bd: int, Ts=(1, 8, 63)) -> None:
    """d 4096: post and M from hc_post(next_fn=, bd=)'s PART within 2e-6 of FP64 at each T."""
    gen = torch.Generator().manual_seed(16)
    fn, scale, base = (t.to(DEV) for t in params((2 + S) * S, 4096, 3, gen))
    for T in Ts:
        X = streams(T, 4096, gen)
        f = torch.randn(T, 4096, generator=gen).bfloat16().to(DEV)
        post = torch.rand(T, S, generator=gen).to(DEV) * 2
        M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
        Y, part = dec.hc_post(f, X, post, M, next_fn=fn, bd=bd)
        _, p, m = dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, part=part)
        p_ref, m_ref = ref_post_m_fp64(Y, fn, scale, base)
        p, m = p.cpu(), m.cpu()
        assert rel_max(p, p_ref) < 2e-6 and rel_max(m, m_ref) < 2e-6, (T, bd, rel_max(m, m_ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("bd", [16, 32, 64, 128])
def test_gpu_post_mix_partials_as_accurate_as_hc_pres_own(bd):
    kernel_module("mhc.core", "_collapse_kernel", False)
    kernel_module("pointwise", "_combine_kernel", False)
    check(kernel_module("mhc.decode", "_post_mix_kernel", False), bd)
