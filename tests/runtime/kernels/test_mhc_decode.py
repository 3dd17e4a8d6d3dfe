"""mHC decode kernels (runtime.kernels.mhc.decode) against today's kernels
(runtime.kernels.mhc.core)
and the torch reference (runtime.model.hyper + layers.RMSNorm's math), under the interpreter on
CPU. Tolerances as test_mhc: post / M 2e-5 relative, bf16 outputs within one bf16 ulp of the
reference's FP32 value (+ FP32 noise). Under the interpreter (one numpy op order) u, post, M and
hc_post's out must also be bit-identical to mhc's kernels given the same inputs / partials.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import kernel_module, one_thread

sys.path.insert(0, str(Path(__file__).parent))
from test_mhc import (
    DEV,
    HC_EPS,
    INTERPRET,
    ITERS,
    NORM_EPS,
    S,
    _count_launches,
    params,
    ref_pre_gates,
    ref_u_fp32,
    rel_max,
    streams,
    ulps,
)

from backfit.runtime.model import hyper

RMS_EPS = 1e-6


@pytest.fixture(scope="module")
def mods():
    """(mhc, mhc_decode), decorated for the interpreter iff INTERPRET."""
    kernel_module("linear.gemm", "_a16_kernel", INTERPRET)
    mhc = kernel_module("mhc.core", "_collapse_kernel", INTERPRET)
    kernel_module("pointwise", "_combine_kernel", INTERPRET)     # hc_post's PairSum sum
    return mhc, kernel_module("mhc.decode", "_post_mix_kernel", INTERPRET)


def rms_ref(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """layers.RMSNorm's FP32 value before its bf16 cast."""
    uf = u.float()
    return uf * torch.rsqrt(uf.square().mean(-1, keepdim=True) + RMS_EPS) * w


def same_or_close(a, b, name):
    """Interpreter: bit-identical; GPU (other reduction trees): within test_mhc's tolerances."""
    if INTERPRET:
        assert torch.equal(a, b), name
    else:
        assert rel_max(a, b) < (2e-5 if a.dtype == torch.float32 else 1e-2), name


# warps 1, bd 256: d 600 takes three blocks a u pass (the last ragged); scalar False: the
# [S, S] tensor Sinkhorn of mhc._collapse_kernel (M bit-identical to it under the interpreter)
@pytest.mark.parametrize("T,d,warps,scalar", [(1, 64, None, None), (3, 256, None, False),
                                              (8, 100, None, None), (2, 600, 1, True)])
def test_collapse_norm_matches_mhc_and_rmsnorm(mods, T, d, warps, scalar):
    mhc, dec = mods
    gen = torch.Generator().manual_seed(T * 31 + d)
    fn, scale, base = params((2 + S) * S, d, 3, gen)
    hfn, hscale, hbase = params(S, d, 1, gen)
    X = streams(T, d, gen)
    w = (torch.rand(d, generator=gen) + 0.5).to(DEV)
    u, post, M = dec.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, warps=warps,
                            bd=256 if warps else None, scalar=scalar)
    u_old, post_old, M_old = mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    same_or_close(u, u_old, "u")
    same_or_close(post, post_old, "post")
    if scalar is False:
        same_or_close(M, M_old, "M")
    assert rel_max(M, M_old) < 2e-5
    with one_thread():
        _, post_ref, M_ref = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        pre = ref_pre_gates(X, fn, scale, base)
        u32, mag = ref_u_fp32(X, pre), ref_u_fp32(X.abs(), pre.abs())
    assert rel_max(post, post_ref) < 2e-5 and rel_max(M, M_ref) < 2e-5
    assert ulps(u, u32, mag) <= 1
    un, post_n, M_n = dec.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=(w, RMS_EPS),
                                 warps=warps, bd=256 if warps else None)
    assert torch.equal(post_n, post) and torch.equal(M_n, M)
    want = rms_ref(u, w)                                  # RMSNorm of the kernel's own bf16 u
    assert un.dtype == torch.bfloat16 and ulps(un, want, want.abs()) <= 1
    h = dec.hc_head(X, hfn, hscale, hbase, HC_EPS, NORM_EPS)
    same_or_close(h, mhc.hc_head(X, hfn, hscale, hbase, HC_EPS, NORM_EPS), "h")
    hn = dec.hc_head(X, hfn, hscale, hbase, HC_EPS, NORM_EPS, norm=(w, RMS_EPS), warps=warps,
                     bd=256 if warps else None)
    want = rms_ref(h, w)
    assert ulps(hn, want, want.abs()) <= 1


@pytest.mark.parametrize("T,d,bd", [(1, 64, None), (3, 256, None), (8, 100, 32), (3, 256, 16)])
def test_post_mix_out_and_next_partials(mods, T, d, bd):
    """hc_post's out as mhc.hc_post; PART summed over d blocks = fn_next · out (bf16) and Σ out²;
    the next hc_pre / hc_head from that PART against the torch reference on out."""
    mhc, dec = mods
    gen = torch.Generator().manual_seed(T * 7 + d)
    fn, scale, base = params((2 + S) * S, d, 3, gen)
    hfn, hscale, hbase = params(S, d, 1, gen)
    X = streams(T, d, gen)
    f = (torch.randn(T, d, generator=gen) * 2).bfloat16().to(DEV)
    post = (torch.rand(T, S, generator=gen) * 2).to(DEV)
    M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
    out, part = dec.hc_post(f, X, post, M, next_fn=fn, bd=bd)
    same_or_close(out, mhc.hc_post(f, X, post, M), "out")
    same_or_close(dec.hc_post(f, X, post, M, bd=bd), out, "out without next_fn")
    assert part.shape == (T, -(-d // (bd or dec.post_bd(T, d))), 32)
    xf = out.flatten(1).double()
    assert rel_max(part.sum(1)[:, :24], xf @ fn.double().T) < 2e-5
    assert rel_max(part.sum(1)[:, 24], xf.square().sum(-1)) < 2e-5
    with one_thread():
        _, post_ref, M_ref = hyper.hc_pre(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        pre = ref_pre_gates(out, fn, scale, base)
        u32, mag = ref_u_fp32(out, pre), ref_u_fp32(out.abs(), pre.abs())
    u, post2, M2 = dec.hc_pre(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS, part=part)
    assert rel_max(post2, post_ref) < 2e-5 and rel_max(M2, M_ref) < 2e-5
    assert ulps(u, u32, mag) <= 1
    out_h, part_h = dec.hc_post(f, X, post, M, next_fn=hfn, bd=bd)
    assert torch.equal(out_h, out) and part_h.shape[2] == 8
    h = dec.hc_head(out, hfn, hscale, hbase, HC_EPS, NORM_EPS, part=part_h)
    m = hyper._mix_logits(out, hfn, NORM_EPS)
    pre_h = torch.sigmoid(m * hscale[0] + hbase) + HC_EPS
    assert ulps(h, ref_u_fp32(out, pre_h), ref_u_fp32(out.abs(), pre_h.abs())) <= 1


def test_two_launches_per_pair_and_bad_input(mods, monkeypatch):
    """hc_post(next_fn) + hc_pre(part, norm): exactly _post_mix_kernel + _collapse_norm_kernel and
    no other device op; clear errors for a wrong part / norm / next_fn / bd."""
    _, dec = mods
    launches, mode = _count_launches(monkeypatch, dec, ("_post_mix_kernel",
                                                        "_collapse_norm_kernel"))
    gen = torch.Generator().manual_seed(5)
    fn, scale, base = params((2 + S) * S, 64, 3, gen)
    X = streams(2, 64, gen)
    w = torch.ones(64).to(DEV)
    f, post, M = X[:, 0].contiguous(), torch.rand(2, S).to(DEV), torch.rand(2, S, S).to(DEV)
    free = {"empty", "view", "select", "slice", "_reshape_alias", "as_strided"}
    with mode:
        Y, part = dec.hc_post(f, X, post, M, next_fn=fn)
        dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=(w, RMS_EPS), part=part)
    assert launches == ["_post_mix_kernel", "_collapse_norm_kernel"], launches
    assert set(mode.ops) <= free, mode.ops
    run = lambda **kw: dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, **kw)
    with pytest.raises(ValueError, match="part must be"):
        run(part=part[:, :, :16].contiguous())
    with pytest.raises(ValueError, match="norm weight"):
        run(norm=(w[:32], RMS_EPS))
    with pytest.raises(ValueError, match="next_fn must be"):
        dec.hc_post(f, X, post, M, next_fn=fn[:, :64])
    with pytest.raises(ValueError, match="bd must be"):
        dec.hc_post(f, X, post, M, next_fn=fn, bd=24)


@pytest.mark.parametrize("T,d", [(1, 64), (5, 256)])
def test_pre_async_equals_pre(mods, T, d):
    """hc_pre_async's two launches (gates + u + norm at COLLAPSE_U's tile; post + M) write what
    hc_pre's one writes at those tiles, bit for bit (the same ops per output); on CUDA post / M
    come from the side stream (joined here), elsewhere nothing is pending."""
    _, dec = mods
    gen = torch.Generator().manual_seed(T + d)
    fn, scale, base = params((2 + S) * S, d, 3, gen)
    X = streams(T, d, gen)
    w = (torch.rand(d, generator=gen) + 0.5).to(DEV)
    f = torch.randn(T, d, generator=gen).bfloat16().to(DEV)
    post0, M0 = torch.rand(T, S, generator=gen).to(DEV), torch.rand(T, S, S, generator=gen).to(DEV)
    with one_thread():
        Y, part = dec.hc_post(f, X, post0, M0, next_fn=fn)
        cu = dec.collapse_config(T, dec.COLLAPSE_U)          # the critical launch's own tile
        for norm, p in (((w, RMS_EPS), part), (None, None)):
            want = dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=norm, part=p)
            want_u = dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=norm, part=p,
                                warps=cu["warps"], bd=cu["bd"])[0]
            *got, wait = dec.hc_pre_async(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=norm,
                                          part=p)
            assert (wait is None) == (DEV == "cpu")
            if wait is not None:
                dec.join(wait)
            assert torch.equal(got[0], want_u), norm is None
            assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:])), norm is None


def test_decode_kernels_switch(mods, monkeypatch):
    import backfit.runtime.kernels as pkg
    _, dec = mods
    X = torch.zeros(2, S, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(pkg, "_backend", "triton")
    assert hyper.decode_kernels(X) is None                             # CPU tensor
    monkeypatch.setattr(pkg, "_ANY_DEVICE", True)
    assert hyper.decode_kernels(X) is dec
    assert hyper.decode_kernels(X.float()) is None                     # FP32 streams
    assert hyper.decode_kernels(torch.zeros(64, S, 8, dtype=torch.bfloat16)) is None  # prefill
    monkeypatch.setattr(dec, "DECODE_FUSED", False)
    assert hyper.decode_kernels(X) is None


@pytest.mark.skipif(not INTERPRET, reason="CPU model through the interpreted kernels")
def test_tiny_model_forward_through_mhc_decode(mods, bf16_tp1, build_model, monkeypatch):
    """Transformer.hidden / Block / logits on the mhc_decode path (attention, MoE on torch) vs
    the torch path, as test_mhc's tiny-model test: the partials carried layer to layer and
    into hc_head, so in the whole forward only the first hc_pre runs _mix_partial_kernel (and
    hc_head with last_only, whose selected rows are not hidden()'s X)."""
    from backfit.runtime.batch import ForwardBatch
    from backfit.runtime.model import transformer
    mhc, dec = mods
    model = build_model(bf16_tp1, torch.bfloat16)
    tokens = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ForwardBatch.single(tokens))
        launches, _ = _count_launches(monkeypatch, mhc, ("_mix_partial_kernel",))
        monkeypatch.setattr(transformer, "decode_kernels", lambda X: dec)
        X = model.hidden(ForwardBatch.single(tokens))
        got = model.logits(X)                                      # = model(batch)
        assert launches == ["_mix_partial_kernel"] and model.cfg.num_hidden_layers >= 2
        last = model.logits(X[-1:])                                # last_only's rows
    assert launches == ["_mix_partial_kernel"] * 2
    assert rel_max(last, got[-1:]) < 1e-2 and torch.equal(last.argmax(-1), got[-1:].argmax(-1))
    err = ((got.double() - want.double()).abs().amax(-1) / want.double().abs().amax(-1)).max()
    assert err < 3e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), err.item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_pair_real_shapes_graph_capturable(mods):
    """d 4096, T 1 / 8 / 63: the fused pair against the torch reference, no host sync (sync
    debug mode "error"), captured in a CUDA graph and replayed to the same bits."""
    _, dec = mods
    gen = torch.Generator().manual_seed(16)
    fn, scale, base = params((2 + S) * S, 4096, 3, gen)
    w = (torch.rand(4096, generator=gen) + 0.5).cuda()
    for T in (1, 8, 63):
        X = streams(T, 4096, gen)
        f = torch.randn(T, 4096, generator=gen).bfloat16().cuda()
        post = torch.rand(T, S, generator=gen).cuda() * 2
        M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).cuda()

        def step(f=f, X=X, post=post, M=M):
            Y, part = dec.hc_post(f, X, post, M, next_fn=fn)
            return (Y,) + dec.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS,
                                     norm=(w, RMS_EPS), part=part)

        def step_async(f=f, X=X, post=post, M=M):     # Sinkhorn on the side stream, joined
            Y, part = dec.hc_post(f, X, post, M, next_fn=fn)
            u, p, m, wait = dec.hc_pre_async(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS,
                                             norm=(w, RMS_EPS), part=part)
            assert wait is not None
            Y2 = dec.hc_post(f, Y, p, m, wait=wait)   # the next hc_post reads post / M
            return Y, u, p, m, Y2
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager, eager_a = step(), step_async()
            graph, graph_a = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = step()
            with torch.cuda.graph(graph_a):
                out_a = step_async()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph.replay()
        graph_a.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, eager)), T
        assert all(torch.equal(a, b) for a, b in zip(out_a, eager_a)), T
        cu = dec.collapse_config(T, dec.COLLAPSE_U)            # = hc_pre (u at its own tile)
        _, part = dec.hc_post(f, X, post, M, next_fn=fn)
        assert torch.equal(eager_a[1], dec.hc_pre(eager[0], fn, scale, base, ITERS, HC_EPS,
                                                  NORM_EPS, norm=(w, RMS_EPS), part=part,
                                                  warps=cu["warps"], bd=cu["bd"])[0]), T
        assert all(torch.equal(eager_a[i], eager[i]) for i in (0, 2, 3)), T
        assert torch.equal(eager_a[4], dec.hc_post(f, eager[0], eager[2], eager[3])), T
        Y = eager[0]
        u_ref, post_ref, M_ref = hyper.hc_pre(Y, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        assert rel_max(eager[2], post_ref) < 2e-5 and rel_max(eager[3], M_ref) < 2e-5, T
        assert rel_max(eager[1], rms_ref(u_ref, w)) < 2e-2, T


@pytest.mark.parametrize("T,d,k,shared", [(1, 64, 6, True), (3, 256, 6, False), (2, 100, 1, True)])
def test_post_mix_sums_moe_pairs_as_moe_combine(mods, T, d, k, shared):
    """hc_post given the MoE's unsummed pairs (pointwise.PairSum, summed to bf16 as at tp 1) =
    hc_post of moe_combine's output, bit for bit (out and the next partials): the same FP32 sum
    in the same order, the same rounding. Other sums' dtypes and bad pairs: clear errors."""
    mhc, dec = mods
    pw = kernel_module("pointwise", "_combine_kernel", INTERPRET)
    gen = torch.Generator().manual_seed(T * 5 + d + k)
    fn, _, _ = params((2 + S) * S, d, 3, gen)
    X = streams(T, d, gen)
    pairs = (torch.randn(T * k, d, generator=gen) * 3).bfloat16().to(DEV)
    sh = (torch.randn(T, d, generator=gen) * 2).bfloat16().to(DEV) if shared else None
    post = (torch.rand(T, S, generator=gen) * 2).to(DEV)
    M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
    bf = torch.bfloat16
    got = dec.hc_post(pw.combine_later(pairs, k, sh, bf), X, post, M, next_fn=fn)
    want = dec.hc_post(pw.moe_combine(pairs, k, sh, bf), X, post, M, next_fn=fn)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(dec.hc_post(pw.combine_later(pairs, k, sh, bf), X, post, M), want[0])
    with pytest.raises(ValueError, match="summed to"):
        dec.hc_post(pw.combine_later(pairs, k, sh, torch.float16), X, post, M)
    with pytest.raises(ValueError, match="contiguous out"):
        pw.combine_later(pairs.t() if k == 1 else pairs[:-1], k, sh, bf)


@pytest.mark.parametrize("T,d", [(1, 64), (3, 100)])
def test_post_mix_rounds_an_fp32_sum_as_its_cast(mods, T, d):
    """At tp > 1 the decode Block's MoE hands hc_post its all-reduced FP32 sum as a PairSum of
    one: = hc_post of that sum's .to(bf16) (the launch it replaces), bit for bit."""
    mhc, dec = mods
    pw = kernel_module("pointwise", "_combine_kernel", INTERPRET)
    gen = torch.Generator().manual_seed(T + d)
    fn, _, _ = params((2 + S) * S, d, 3, gen)
    X = streams(T, d, gen)
    y = (torch.randn(T, d, generator=gen) * 3).to(DEV)                  # FP32, not bf16-exact
    post = (torch.rand(T, S, generator=gen) * 2).to(DEV)
    M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
    got = dec.hc_post(pw.combine_later(y, 1, None, torch.bfloat16), X, post, M, next_fn=fn)
    # the interpreter's FP32 -> BF16 cast truncates (the GPU's rounds to nearest, as torch)
    yb = (y.view(torch.int32) & ~0xFFFF).view(torch.float32) if INTERPRET else y
    want = dec.hc_post(yb.to(torch.bfloat16), X, post, M, next_fn=fn)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# bd_u None: FOLD's; 600 with 128: five ragged two-pass blocks; 64 with 64: the one-pass form
@pytest.mark.parametrize("T,d,bd_u,k", [(1, 64, None, 0), (3, 256, 64, 6), (2, 600, 128, 0),
                                        (2, 64, 64, 1)])
def test_post_mix_runs_the_next_pre_in_its_last_programs(mods, T, d, bd_u, k, monkeypatch):
    """hc_post(pre=): out and PART as without pre; u = the next hc_pre's critical launch
    (gates + u + RMSNorm) at d block bd_u, bit for bit under the interpreter, within one bf16
    ulp of the RMSNorm of the torch reference's u; token counters back at 0 (a second call
    gives the same bits); hc_pre_async(u=) then launches the Sinkhorn only."""
    mhc, dec = mods
    pw = kernel_module("pointwise", "_combine_kernel", INTERPRET)
    gen = torch.Generator().manual_seed(T * 11 + d + k)
    fn, scale, base = params((2 + S) * S, d, 3, gen)
    X = streams(T, d, gen)
    w = (torch.rand(d, generator=gen) + 0.5).to(DEV)
    post = (torch.rand(T, S, generator=gen) * 2).to(DEV)
    M = torch.softmax(torch.randn(T, S, S, generator=gen), -1).to(DEV)
    if k:                                                # the MoE's pairs, summed in the launch
        pairs = (torch.randn(T * k, d, generator=gen) * 3).bfloat16().to(DEV)
        f = pw.combine_later(pairs, k, None, torch.bfloat16)
    else:
        f = (torch.randn(T, d, generator=gen) * 2).bfloat16().to(DEV)
    nxt = dec.NextPre(scale, base, w, RMS_EPS, HC_EPS, NORM_EPS)
    out, part, u = dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt, bd_u=bd_u)
    want_out, want_part = dec.hc_post(f, X, post, M, next_fn=fn)
    same_or_close(out, want_out, "out")
    same_or_close(part, want_part, "part")
    bd = min(bd_u or dec.FOLD["bd_u"], 1 << (d - 1).bit_length())
    want_u, post_w, M_w = dec.hc_pre(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS,
                                     norm=(w, RMS_EPS), part=part, bd=bd)
    same_or_close(u, want_u, "u")
    u_plain = dec.hc_pre(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS, part=part, bd=bd)[0]
    want = rms_ref(u_plain, w)                           # RMSNorm of the kernel's own bf16 u
    assert u.dtype == torch.bfloat16 and ulps(u, want, want.abs()) <= 1
    from backfit.runtime.streams import stream_counters
    assert not stream_counters(X.device, T)[:T].any()    # reset by each token's last program
    again = dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt, bd_u=bd_u)
    assert all(torch.equal(a, b) for a, b in zip(again, (out, part, u)))
    launches, _ = _count_launches(monkeypatch, dec, ("_post_mix_kernel", "_collapse_norm_kernel"))
    got = dec.hc_pre_async(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm=(w, RMS_EPS),
                           part=part, u=u)
    if got[3] is not None:
        dec.join(got[3])
    assert launches == ["_collapse_norm_kernel"], launches       # post + M only
    assert got[0] is u and torch.equal(got[1], post_w) and torch.equal(got[2], M_w)


def test_post_mix_pre_bad_input(mods):
    """pre= without the next hc_pre's next_fn, a bad bd_u or norm weight, a wrong u: errors;
    past FOLD_MAX_T tokens pre is not run (u None, out and PART as without it)."""
    _, dec = mods
    gen = torch.Generator().manual_seed(3)
    fn, scale, base = params((2 + S) * S, 64, 3, gen)
    hfn, _, _ = params(S, 64, 1, gen)
    X = streams(2, 64, gen)
    f, post, M = X[:, 0].contiguous(), torch.rand(2, S).to(DEV), torch.rand(2, S, S).to(DEV)
    nxt = dec.NextPre(scale, base, torch.ones(64).to(DEV), RMS_EPS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="pre= needs"):
        dec.hc_post(f, X, post, M, pre=nxt)
    with pytest.raises(ValueError, match="pre= needs"):
        dec.hc_post(f, X, post, M, next_fn=hfn, pre=nxt)           # hc_head's fn
    with pytest.raises(ValueError, match="bd_u must be"):
        dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt, bd_u=24)
    with pytest.raises(ValueError, match="norm weight"):
        dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt._replace(norm_w=torch.ones(32).to(DEV)))
    out, part, u = dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt)
    with pytest.raises(ValueError, match="u must be"):
        dec.hc_pre_async(out, fn, scale, base, ITERS, HC_EPS, NORM_EPS, part=part, u=u[:1])
    T = dec.FOLD_MAX_T + 1                                  # past it: not folded, u None
    X = streams(T, 64, gen)
    f, post, M = X[:, 1].contiguous(), torch.rand(T, S).to(DEV), torch.rand(T, S, S).to(DEV)
    out, part, u = dec.hc_post(f, X, post, M, next_fn=fn, pre=nxt)
    want = dec.hc_post(f, X, post, M, next_fn=fn)
    assert u is None and torch.equal(out, want[0]) and torch.equal(part, want[1])
