"""The fused router (runtime.kernels.router: logits GEMV + route in one launch) against the torch
math of runtime/model/moe.py's Gate.route: x·Gᵀ in FP32 (FP64 here, the oracle), sqrt-softplus,
top-k of s + bias or tid2eid[token], normalised weights.

CPU: the Triton interpreter. Weights drawn so that no two of a token's scores near its k-th are
within FP32 noise of each other: the same experts in the same order; weights to 1e-5 (the FP32
logits' summation order is the kernel's own). The counter the last program uses is left at 0
(a second call, as a graph replay, gives the same result), and bad input is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module  # noqa: E402

from backfit.runtime.streams import stream_counters  # noqa: E402


def kmod():
    return kernel_module("router", "_router_kernel", INTERPRET)


def _ref(x, w, k, scale, bias=None, tid2eid=None, tokens=None):
    logits = (x.double() @ w.double().T).float()
    s = torch.sqrt(F.softplus(logits))
    idx = tid2eid[tokens].long() if tid2eid is not None else (s + bias).topk(k, dim=-1).indices
    ws = s.gather(1, idx)
    return idx, ws / ws.sum(-1, keepdim=True) * scale


def _case(T, E, D, gen):
    x = torch.randn(T, D, generator=gen).bfloat16()
    w = (torch.randn(E, D, generator=gen) / D ** 0.5 * 4).bfloat16()
    return x.to(DEV), w.to(DEV)


@pytest.mark.parametrize("T, E, D, k", [(1, 256, 512, 6), (8, 64, 256, 6), (3, 20, 100, 3)])
def test_router_equals_gemv_then_route(T, E, D, k):
    m = kmod()
    g = torch.Generator().manual_seed(T * E + D)
    x, w = _case(T, E, D, g)
    bias = (torch.randn(E, generator=g) * 0.01).to(DEV)
    rid, rw = _ref(x, w, k, 2.5, bias=bias)
    for _ in range(2):                                  # the counter is reset by the last program
        ids, wt = m.router(x, w, k, 2.5, bias=bias)
        assert ids.dtype == torch.int64 and ids.shape == (T, k) and torch.equal(ids, rid)
        torch.testing.assert_close(wt, rw, rtol=1e-5, atol=1e-6)
        assert not stream_counters(x.device, T)[:T].any()
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)]).to(DEV)
    tokens = torch.randint(0, 50, (T,), generator=g).to(DEV)
    ids, wt = m.router(x, w, k, 1.5, tid2eid=tid2eid, tokens=tokens)
    rid, rw = _ref(x, w, k, 1.5, tid2eid=tid2eid, tokens=tokens)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(wt, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash"])
def test_router_bias_vl(hashed):
    """Vision-Exp: the fused launch routes image-block rows (token >= vocab) with bias_vl, hash
    layers included, as pointwise.route does (test_pointwise's oracle)."""
    from test_pointwise import _route_vl_ref, vl_case
    m = kmod()
    T, E, D, k, V = 8, 20, 64, 3, 50
    g = torch.Generator().manual_seed(3)
    x, w = _case(T, E, D, g)
    _, bias, bias_vl, tokens, tid2eid = vl_case(T, E, k, V, 6)
    kw = dict(tid2eid=tid2eid) if hashed else dict(bias=bias)
    ids, wt = m.router(x, w, k, 1.5, tokens=tokens, bias_vl=bias_vl, vocab=V, **kw)
    logits = (x.double() @ w.double().T).float()
    rid, rw = _route_vl_ref(logits, k, 1.5, tokens, V, bias_vl=bias_vl, **kw)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(wt, rw, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="router: either"):
        m.router(x, w, k, 1.0, bias=bias, bias_vl=bias_vl)                    # no vocab


def test_router_config_override_and_strided_rows():
    """Several rows a program, a K loop of several steps, x rows from a wider tensor."""
    m = kmod()
    g = torch.Generator().manual_seed(7)
    x, w = _case(2, 40, 384, g)
    wide = torch.zeros(2, 512, dtype=torch.bfloat16, device=DEV)
    wide[:, :384] = x
    bias = torch.zeros(40, device=DEV)
    ids, wt = m.router(wide[:, :384], w, 4, 1.0, bias=bias, config=dict(BN=4, BK=128))
    rid, rw = _ref(x, w, 4, 1.0, bias=bias)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(wt, rw, rtol=1e-5, atol=1e-6)


def test_router_refuses_bad_input():
    m = kmod()
    g = torch.Generator().manual_seed(1)
    x, w = _case(2, 16, 64, g)
    bias = torch.zeros(16, device=DEV)
    with pytest.raises(ValueError, match="router: bf16 x"):
        m.router(x.float(), w, 2, 1.0, bias=bias)
    with pytest.raises(ValueError, match="router: bf16 x"):
        m.router(torch.zeros(m.ROUTER_MAX_M + 1, 64, dtype=torch.bfloat16, device=DEV), w, 2,
                 1.0, bias=bias)
    with pytest.raises(ValueError, match="router: contiguous bf16 weight"):
        m.router(x, w[:, :32], 2, 1.0, bias=bias)
    with pytest.raises(ValueError, match="router: either"):
        m.router(x, w, 2, 1.0)
    with pytest.raises(ValueError, match="router: either"):
        m.router(x, w, 2, 1.0, bias=torch.zeros(15, device=DEV))
