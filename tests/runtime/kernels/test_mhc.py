"""mHC kernels (runtime.kernels.mhc.core) against the torch reference (runtime.model.hyper), and the
FP32-output linear (kernels.linear.gemm.linear(out_dtype=float32), Linear.forward_f32,
ParallelHead).

CPU: the Triton interpreter (TRITON_INTERPRET=1 while the module is imported). All mHC math is
FP32, so post and M must agree to 2e-5 relative (max abs error over max abs value; only the
summation order of the 16384-long dots and rsqrt/exp rounding differ). u and the hc_post output
are bf16: they are compared with the reference's FP32 value before its bf16 cast and must lie
within one bf16 ulp of it (the interpreter's fp32->bf16 cast truncates, a GPU rounds to nearest:
either is within one ulp), plus 1e-6 x Σ|terms| for the FP32 noise of the value itself (the
gates carry ~1e-6 relative noise; where streams cancel, that is more than the ulp of u).
A wrong stream, gate, index or Sinkhorn pass gives O(1) errors.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from support import kernel_module, one_thread
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from backfit.runtime import layers
from backfit.runtime.layers import Linear, ParallelHead
from backfit.runtime.model import hyper

S, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
FP32_NOISE = 1e-6       # x Σ|terms|: FP32 noise of a bf16 output's value (measured <= 1.3e-7)


@pytest.fixture(scope="module")
def mhc():
    kernel_module("linear.gemm", "_a16_kernel", INTERPRET)   # triton imported before the env
    kernel_module("mhc.tile", "_mix_tile_kernel", INTERPRET)  # was set: mhc's tiled prefill
    return kernel_module("mhc.core", "_collapse_kernel", INTERPRET)


@pytest.fixture(scope="module")
def gemm(mhc):
    import backfit.runtime.kernels.linear.gemm as gemm
    return gemm


def params(n_out: int, d: int, n_scale: int, gen: torch.Generator):
    """Realistic scales: fn ~ N(0, 0.02), base and scale ~ N(0, 1); FP32 as in the checkpoint."""
    fn = (torch.randn(n_out, S * d, generator=gen) * 0.02).to(DEV)
    scale, base = torch.randn(n_scale, generator=gen), torch.randn(n_out, generator=gen)
    return fn, scale.to(DEV), base.to(DEV)


def streams(T: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """X [T, S, d] bf16 with a per-stream magnitude spread (residual streams differ in scale)."""
    x = torch.randn(T, S, d, generator=gen) * torch.rand(T, S, 1, generator=gen).add(0.2) * 3
    return x.bfloat16().to(DEV)


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def ulps(out: torch.Tensor, want_fp32: torch.Tensor, mag: torch.Tensor) -> float:
    """Worst |out - want| - FP32_NOISE·mag in units of the bf16 spacing at |want| (out bf16,
    want FP32, mag = Σ|terms| of want)."""
    w = want_fp32.double().cpu()
    spacing = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    err = (out.double().cpu() - w).abs() - FP32_NOISE * mag.double().cpu()
    return (err / spacing).max().item()


def ref_u_fp32(X, pre_fn):
    return torch.einsum("ts,tsd->td", pre_fn, X.float())


def ref_pre_gates(X, fn, scale, base):
    m = hyper._mix_logits(X, fn, NORM_EPS)
    return torch.sigmoid(m[:, :S] * scale[0] + base[:S]) + HC_EPS


# (T, d, forced K splits): auto splits, one split, 3 (padded to 4 in the gather), 128 (the T = 1
# decode split on an H200/A100), d = 100 (K = 400: a ragged last K step and d block), T >= 64
# (torch matmul logits) and the same T forced through the split kernel
CASES = [(1, 64, None), (3, 256, None), (3, 256, 1), (17, 64, None), (17, 256, 3),
         (3, 100, None), (130, 64, None), (130, 64, 3), (1, 4096, None), (1, 4096, 128)]


def pre_case(T: int, d: int, seed: int):
    """hc_pre's inputs (X [T, S, d], fn, scale, base) and the torch reference's (post, M, u's
    FP32 value before the bf16 cast, Σ|terms| of u)."""
    gen = torch.Generator().manual_seed(seed)
    fn, scale, base = params((2 + S) * S, d, 3, gen)
    X = streams(T, d, gen)
    with one_thread():
        _, post_ref, M_ref = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        pre = ref_pre_gates(X, fn, scale, base)
        u32, mag = ref_u_fp32(X, pre), ref_u_fp32(X.abs(), pre.abs())
    return (X, fn, scale, base), (post_ref, M_ref, u32, mag)


def assert_pre_close(got, want) -> None:
    """hc_pre's (u, post, M) against pre_case's reference: shapes, dtypes, test_mhc's bounds."""
    (u, post, M), (post_ref, M_ref, u32, mag) = got, want
    T, d = u32.shape
    assert u.shape == (T, d) and u.dtype == torch.bfloat16
    assert post.shape == (T, S) and M.shape == (T, S, S) and M.dtype == torch.float32
    assert rel_max(post, post_ref) < 2e-5, (T, d, rel_max(post, post_ref))
    assert rel_max(M, M_ref) < 2e-5, (T, d, rel_max(M, M_ref))
    assert ulps(u, u32, mag) <= 1, (T, d, ulps(u, u32, mag))


@pytest.mark.parametrize("T,d,split", CASES)
def test_hc_pre_matches_torch_reference(mhc, T, d, split):
    args, want = pre_case(T, d, T * 1000 + d)
    u, post, M = mhc.hc_pre(*args, ITERS, HC_EPS, NORM_EPS, split=split)
    assert_pre_close((u, post, M), want)
    # M is (close to) doubly stochastic after 20 passes: a real property, not only a copy
    assert (M.sum(-2) - 1).abs().max() < 1e-4


@pytest.mark.parametrize("T,d,split", [(1, 64, None), (17, 256, None), (130, 64, None),
                                       (1, 4096, None)])
def test_hc_head_matches_torch_reference(mhc, T, d, split):
    gen = torch.Generator().manual_seed(T * 7 + d)
    fn, scale, base = params(S, d, 1, gen)
    X = streams(T, d, gen)
    with one_thread():
        m = hyper._mix_logits(X, fn, NORM_EPS)
        pre = torch.sigmoid(m * scale[0] + base) + HC_EPS
        want, mag = ref_u_fp32(X, pre), ref_u_fp32(X.abs(), pre.abs())
        assert torch.equal(hyper.hc_head(X, fn, scale, base, HC_EPS, NORM_EPS), want.bfloat16())
    h = mhc.hc_head(X, fn, scale, base, HC_EPS, NORM_EPS, split=split)
    assert h.shape == (T, d) and h.dtype == torch.bfloat16
    assert ulps(h, want, mag) <= 1, (T, d, ulps(h, want, mag))


@pytest.mark.parametrize("T,d", [(1, 64), (3, 256), (17, 64), (130, 64), (1, 4096)])
def test_hc_post_matches_torch_reference(mhc, T, d):
    gen = torch.Generator().manual_seed(T + d)
    X = streams(T, d, gen)
    f = torch.randn(T, d, generator=gen).bfloat16().to(DEV)
    post = (2 * torch.rand(T, S, generator=gen)).to(DEV)
    M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
    with one_thread():
        mixed = torch.einsum("tjk,tjd->tkd", M, X.float())
        want = post[:, :, None] * f.float()[:, None, :] + mixed
        mag = post[:, :, None] * f.float().abs()[:, None, :] + torch.einsum(
            "tjk,tjd->tkd", M, X.float().abs())
        assert torch.equal(hyper.hc_post(f, X, post, M), want.bfloat16())
    out = mhc.hc_post(f, X, post, M)
    assert out.shape == (T, S, d) and out.dtype == torch.bfloat16
    assert ulps(out, want, mag) <= 1, (T, d, ulps(out, want, mag))


def test_deterministic_and_bad_input(mhc):
    gen = torch.Generator().manual_seed(11)
    fn, scale, base = params((2 + S) * S, 256, 3, gen)
    X = streams(3, 256, gen)
    a = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    b = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    dec = kernel_module("mhc.decode", "_post_mix_kernel", INTERPRET)
    calls = [(lambda: mhc.hc_post(X[:, 0], X, a[1][:, :2], a[2]), "post fp32"),
             (lambda: mhc.hc_post(X[:, 0], X, a[1].to("meta"), a[2]), "devices")]
    for pre in (mhc.hc_pre, dec.hc_pre, dec.hc_pre_async):        # one check_pre for all three
        calls += [(lambda pre=pre: pre(X.float(), fn, scale, base, 20, 1e-6, 1e-6), "bf16"),
                  (lambda pre=pre: pre(X, fn[:4], scale, base, 20, 1e-6, 1e-6), "fn must"),
                  (lambda pre=pre: pre(X, fn, scale[:1], base, 20, 1e-6, 1e-6), "scale"),
                  (lambda pre=pre: pre(X, fn, scale, base, 0, 1e-6, 1e-6), "iters")]
    for call, msg in calls:
        with pytest.raises(ValueError, match=msg):
            call()


# tiled prefill path (prefill="tiled", T >= MIX_TORCH_T): tile_config's own choice (BT 128,
# bf16 mma x 3, 2 token blocks at T 200), a ragged everything case (T 130 over BT 16, d 100 over
# BD 32, K 400 over BK 16 in 3 splits), and the FP32 FMA dots in one split
TILED = [(200, 64, None), (130, 100, dict(BT=16, BK=16, split=3, BTU=4, BD=32)),
         (65, 64, dict(MMA3=False, BT=32, BK=32, split=1, BTU=1, BD=64))]


@pytest.mark.parametrize("T,d,tile", TILED)
def test_tiled_prefill_matches_torch_reference(mhc, T, d, tile):
    args, want = pre_case(T, d, T * 31 + d)
    X, fn, scale, base = args
    with one_thread():                                  # hc_head's reference: the first S rows
        m = hyper._mix_logits(X, fn[:S], NORM_EPS)
        pre_h = torch.sigmoid(m * scale[0] + base[:S]) + HC_EPS
        h32, hmag = ref_u_fp32(X, pre_h), ref_u_fp32(X.abs(), pre_h.abs())
    assert_pre_close(mhc.hc_pre(*args, ITERS, HC_EPS, NORM_EPS, prefill="tiled", tile=tile), want)
    h = mhc.hc_head(X, fn[:S].contiguous(), scale[:1], base[:S].contiguous(), HC_EPS, NORM_EPS,
                    prefill="tiled", tile=tile)
    assert h.shape == (T, d) and ulps(h, h32, hmag) <= 1, (T, d, ulps(h, h32, hmag))


def test_tiled_prefill_dispatch_and_bad_input(mhc, monkeypatch):
    """PREFILL is "tiled" (H200: 2.5 ms -> 0.2 ms at T = 8192); it serves T >= MIX_TORCH_T only
    (decode T keeps the split kernel, same bits), in 2 launches and no other device op."""
    assert mhc.PREFILL == "tiled"
    gen = torch.Generator().manual_seed(16)
    fn, scale, base = params((2 + S) * S, 64, 3, gen)
    small, big = streams(mhc.MIX_TORCH_T - 1, 64, gen), streams(mhc.MIX_TORCH_T, 64, gen)
    run = lambda X, **kw: mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, **kw)  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(run(small, prefill="tiled"), run(small)))
    assert all(torch.equal(a, b) for a, b in zip(run(big), run(big, prefill="tiled")))
    tile_mod = kernel_module("mhc.tile", "_mix_tile_kernel", INTERPRET)
    launches, mode = _count_launches(monkeypatch, tile_mod, ("_mix_tile_kernel",
                                                             "_collapse_tile_kernel"))
    with mode:
        tiled = run(big, prefill="tiled", tile=dict(BT=32, BK=64, split=2))
    assert launches == ["_mix_tile_kernel", "_collapse_tile_kernel"], launches
    assert set(mode.ops) <= {"empty", "view", "_reshape_alias"}, mode.ops
    assert rel_max(tiled[2], run(big)[2]) < 2e-5
    for kw, msg in ((dict(prefill="fast"), "prefill must"), (dict(prefill="tiled", tile=dict(
            BTX=4)), "unknown tile keys"), (dict(prefill="tiled", tile=dict(BT=8)), "BT, BK")):
        with pytest.raises(ValueError, match=msg):
            run(big, **kw)


class _AtenOps(TorchDispatchMode):
    """Records the aten ops run outside the Triton launches (those inside are the interpreter's)."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _count_launches(monkeypatch, mhc, names):
    """Wrap mhc's kernels `names`: -> (launch names in order, an _AtenOps mode that skips the
    ops run inside the launches)."""
    launches, mode = [], _AtenOps()
    for name in names:
        kernel = getattr(mhc, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kw):
                    launches.append(name)
                    mode.inside += 1
                    try:
                        return kernel[grid](*args, **kw)
                    finally:
                        mode.inside -= 1
                return launch
        monkeypatch.setattr(mhc, name, Counted())
    return launches, mode


def test_launches_per_call(mhc, monkeypatch):
    """hc_pre 2, hc_post 1, hc_head 2 launches on the decode path, and no other device op (only
    allocations and views), against 139 / 6 / 14 compute ops for the torch reference."""
    launches, mode = _count_launches(monkeypatch, mhc, ("_mix_partial_kernel", "_collapse_kernel",
                                                        "_post_kernel"))
    gen = torch.Generator().manual_seed(14)
    fn, scale, base = params((2 + S) * S, 64, 3, gen)
    hfn, hscale, hbase = params(S, 64, 1, gen)
    X = streams(2, 64, gen)
    f, post, M = X[:, 0].contiguous(), torch.rand(2, S).to(DEV), torch.rand(2, S, S).to(DEV)
    free = {"empty", "view", "select", "slice", "_reshape_alias", "as_strided"}
    for call, want in ((lambda: mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS),
                        ["_mix_partial_kernel", "_collapse_kernel"]),
                       (lambda: mhc.hc_post(f, X, post, M), ["_post_kernel"]),
                       (lambda: mhc.hc_head(X, hfn, hscale, hbase, HC_EPS, NORM_EPS),
                        ["_mix_partial_kernel", "_collapse_kernel"])):
        launches.clear()
        mode.ops.clear()
        with mode:
            call()
        assert launches == want and set(mode.ops) <= free, (launches, mode.ops)
    with _AtenOps() as ref:
        hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    assert len([o for o in ref.ops if o not in free | {"t", "expand", "unsqueeze", "alias",
                                                       "transpose", "_unsafe_view"}]) > 100


def test_hyper_dispatches_only_for_cuda_bf16_with_triton(monkeypatch):
    calls = []
    fake = type("M", (), {"core": type("K", (), {"hc_post": staticmethod(
        lambda *a: calls.append(a) or "kernel")})})
    import backfit.runtime.kernels as pkg
    monkeypatch.setattr(pkg, "_backend", "triton")                    # read by kernel_path()
    X = torch.zeros(1, S, 8, dtype=torch.bfloat16)
    assert hyper._fused(X) is None                                     # CPU tensor: torch code
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert hyper._fused(X.float()) is None                             # FP32 streams: torch code
    monkeypatch.setattr(pkg, "mhc", fake, raising=False)
    assert hyper.hc_post(X[:, 0], X, torch.zeros(1, S), torch.zeros(1, S, S)) == "kernel"
    monkeypatch.setattr(pkg, "_backend", "torch")
    assert hyper._fused(X) is None and len(calls) == 1


@pytest.mark.skipif(not INTERPRET, reason="CPU model through the interpreted kernels")
def test_tiny_model_forward_through_the_mhc_kernels(mhc, bf16_tp1, build_model, monkeypatch):
    """The real call sites (every layer's hc_pre/hc_post, hc_head) on the tiny bf16 model: logits
    against the torch path. Measured 1.5e-2 under the interpreter, whose truncating bf16 casts bias
    every stream update (with round-to-nearest stores: 1.9e-3, the torch bf16 path's own error
    against FP32 being 4.2e-3); a wrong index or gate gives O(1)."""
    from backfit.runtime.batch import ForwardBatch
    model = build_model(bf16_tp1, torch.bfloat16)
    tokens = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ForwardBatch.single(tokens))
        calls = []
        monkeypatch.setattr(hyper, "_fused", lambda X: calls.append(1) or mhc)
        got = model(ForwardBatch.single(tokens))
    assert len(calls) == 4 * model.cfg.num_hidden_layers + 1       # 2 x (pre, post) + head
    err = ((got.double() - want.double()).abs().amax(-1) / want.double().abs().amax(-1)).max()
    assert err < 3e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), err.item()


# ---- FP32-output linear ----------------------------------------------------------------------

def test_linear_fp32_output_matches_fp32_reference(gemm):
    from backfit.quant import quantize_int8_groups
    gen = torch.Generator().manual_seed(12)
    for m, n, k, split in ((1, 64, 256, None), (5, 96, 128, 2), (130, 32, 256, None)):
        x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
        w = torch.randn(n, k, generator=gen).bfloat16().to(DEV)
        y = gemm.linear(x, w, None, "bf16", split_k=split, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        want = F.linear(x.float(), w.float())
        assert rel_max(y, want) < 1e-5, (m, n, k, rel_max(y, want))      # FP32 summation noise
        q, s = quantize_int8_groups(w.float().cpu())
        q, s = q.to(DEV), s.to(DEV)
        yq = gemm.linear(x, q, s, "int8_g128", split_k=split, out_dtype=torch.float32)
        wq = F.linear(x.float(), (q.float().view(n, -1, 128) * s[:, :, None]).view(n, k))
        assert rel_max(yq, wq) < 1e-5, (m, n, k, rel_max(yq, wq))        # a16 even at m >= 128
    with pytest.raises(ValueError, match="out_dtype"):
        gemm.linear(x, w, None, "bf16", out_dtype=torch.float16)
    with pytest.raises(ValueError, match="FP32 weight"):
        gemm.linear(x, w.float(), None, "copy", out_dtype=torch.float32)


def test_forward_f32_torch_path_and_kernel_dispatch(gemm, monkeypatch, tp1_process):
    gen = torch.Generator().manual_seed(13)
    lin = Linear(128, 48)
    lin.load("copy", torch.randn(48, 128, generator=gen).bfloat16().to(DEV))
    x = torch.randn(3, 2, 128, generator=gen).bfloat16().to(DEV)
    old = F.linear(x.float(), lin.dequantized(torch.float32))       # the router's old expression
    assert torch.equal(lin.forward_f32(x), old)                     # torch backend: same bits
    assert torch.equal(lin.forward_f32(x.float()), old)
    monkeypatch.setattr(layers, "get_kernel_backend", lambda: "triton")
    monkeypatch.setattr(layers, "_on_gpu", lambda t: True)          # interpreter stands for CUDA
    y = lin.forward_f32(x)
    assert y.dtype == torch.float32 and y.shape == (3, 2, 48)
    assert torch.equal(y, gemm.linear(x, lin.weight, None, "copy", out_dtype=torch.float32))
    assert rel_max(y, old) < 1e-5
    assert torch.equal(lin.forward_f32(x.float()), old)             # FP32 x: reference path
    head = ParallelHead(128, 48).to(DEV)
    head.weight.copy_(lin.weight)
    h = x[0]
    yh = head(h)
    assert yh.dtype == torch.float32 and rel_max(yh, F.linear(h.float(), lin.weight.float())) < 1e-5
    monkeypatch.setattr(layers, "get_kernel_backend", lambda: "torch")
    assert torch.equal(head(h), F.linear(h.float(), lin.weight.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shapes_deterministic_and_graph_capturable(mhc):
    """d 4096 at decode and prefill sizes against the torch reference; hc_pre + hc_post with no
    host sync (sync debug mode "error") captured in a CUDA graph and replayed to the same bits."""
    gen = torch.Generator().manual_seed(15)
    fn, scale, base = params((2 + S) * S, 4096, 3, gen)
    for T in (1, 8, 63, 200):
        X = streams(T, 4096, gen)
        u_ref, post_ref, M_ref = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        u, post, M = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        assert rel_max(post, post_ref) < 2e-5 and rel_max(M, M_ref) < 2e-5, T
        assert rel_max(u, u_ref) < 1e-2, T
        again = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        assert all(torch.equal(a, b) for a, b in zip((u, post, M), again)), T
    X = streams(4, 4096, gen)
    f = torch.randn(4, 4096, generator=gen).bfloat16().cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        def step():
            return mhc.hc_post(f, X, *mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)[1:])
        eager = step()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tiled_prefill_real_shapes(mhc):
    """d 4096, T 200 / 1024 through prefill="tiled" (tile_config's own choice and the FP32 FMA
    dots): post, M against the torch reference, u / h within the GPU test's bound, same bits on
    a second call."""
    gen = torch.Generator().manual_seed(17)
    fn, scale, base = params((2 + S) * S, 4096, 3, gen)
    for T in (200, 1024):
        X = streams(T, 4096, gen)
        u_ref, post_ref, M_ref = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        h_ref = hyper.hc_head(X, fn[:S], scale[:1], base[:S], HC_EPS, NORM_EPS)
        for tile in (None, dict(MMA3=False)):
            u, post, M = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS,
                                    prefill="tiled", tile=tile)
            assert rel_max(post, post_ref) < 2e-5 and rel_max(M, M_ref) < 2e-5, (T, tile)
            assert rel_max(u, u_ref) < 1e-2, (T, tile)
            again = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, prefill="tiled",
                               tile=tile)
            assert all(torch.equal(a, b) for a, b in zip((u, post, M), again)), (T, tile)
            h = mhc.hc_head(X, fn[:S].contiguous(), scale[:1], base[:S].contiguous(), HC_EPS,
                            NORM_EPS, prefill="tiled", tile=tile)
            assert rel_max(h, h_ref) < 1e-2, (T, tile)
