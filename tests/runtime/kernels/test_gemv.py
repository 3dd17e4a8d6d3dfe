"""Small-M GEMV kernel (runtime.kernels.linear.gemv) against a plain-torch FP32 reference.

CPU: the Triton interpreter (TRITON_INTERPRET=1 while the module is imported). Reference: the
weight dequantized in FP32 (q·s for int8_g128) and x @ W^T in FP64, so the bound covers only the
kernel's FP32 summation and its output rounding: FP32 output 1e-5 relative (Frobenius), BF16
output 2^-8 (one BF16 rounding, <= 2^-9 per element), 2^-7 under the interpreter (its fp32 -> bf16
cast truncates: < 2^-7 per element). A wrong scale, row, group or K range gives errors of
1e-1..1. Sizes are tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"

from support import kernel_module, one_thread  # noqa: E402

from backfit.quant import quantize_int8_groups  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** (-7 if INTERPRET else -8)}


@pytest.fixture(scope="module")
def gv():
    return kernel_module("linear.gemv", "_gemv_kernel", INTERPRET)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def weights(n: int, k: int, quant: bool, gen: torch.Generator):
    """(weight, scale, FP32 dequantized weight) with per-row magnitude spread, as checkpoints."""
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    if quant:
        q, s = quantize_int8_groups(w)
        deq = (q.float().view(n, k // 128, 128) * s[:, :, None]).view(n, k)
        return q.to(DEV), s.to(DEV), deq
    wb = w.bfloat16()
    return wb.to(DEV), None, wb.float()


def reference(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    return x.cpu().double() @ deq.double().T


# (n, k, config): N not a multiple of BN, K not a multiple of BK, several K steps, one step
CASES = [
    (20, 384, dict(BN=8, BK=256)),              # 3 programs (last one 4 rows), K 1.5 steps
    (7, 640, dict(BN=2, BK=128, num_warps=2)),  # 5 K steps, odd N
    (16, 256, None),                            # the default config (one K step)
    (20, 384, dict(BN=4, BK=128, V8=True, PREFETCH=True)),      # 3 steps double-buffered
    (12, 512, dict(BN=4, BK=256, PREFETCH=True, MAGIC=True)),   # 2 steps double-buffered
    (20, 384, dict(variant="fma", BN=8, BK=256, MAGIC=True)),   # per-thread accumulators
    (7, 640, dict(variant="fma", BN=2, BK=128, num_warps=2)),
    (20, 640, dict(BN=4, BK=128, STAGES=3, MAGIC=True)),        # 5 steps as a cp.async pipeline
    (7, 384, dict(variant="fma", BN=2, BK=128, STAGES=4)),      # (a depth past the step count)
]


@pytest.mark.parametrize("quant", [True, False], ids=["int8_g128", "bf16"])
@pytest.mark.parametrize("n,k,cfg", CASES)
def test_gemv_matches_fp32_reference(gv, quant, n, k, cfg):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, s, deq = weights(n, k, quant, gen)
    scheme = "int8_g128" if quant else "bf16"
    if cfg and not quant:
        cfg = {k: v for k, v in cfg.items() if k != "MAGIC"}          # an int8-only option
    with one_thread():
        for m in (1, 2, 3, 5, 8):
            x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
            want = reference(x, deq)
            for out in (torch.bfloat16, torch.float32):
                y = gv.gemv(x, w, s, scheme, config=cfg, out_dtype=out)
                assert y.shape == (m, n) and y.dtype == out
                assert rel(y, want) < TOL[out], (m, n, k, cfg, out)


def test_magic_conversion_and_bf16_tail(gv):
    """MAGIC gives the same values as the I2F conversion (both exact, same summation order);
    a bf16 K that is not a multiple of 128 is masked (copy scheme, leading dims kept)."""
    gen = torch.Generator().manual_seed(7)
    q, s, deq = weights(12, 512, True, gen)
    q[0, :4] = torch.tensor([127, -127, -1, 0], dtype=torch.int8)         # code extremes
    deq[0] = (q[0].cpu().float().view(4, 128) * s[0].cpu()[:, None]).view(512)
    x = torch.randn(4, 512, generator=gen).bfloat16().to(DEV)
    with one_thread():
        a = gv.gemv(x, q, s, "int8_g128", config=dict(BN=4, BK=256, MAGIC=True),
                    out_dtype=torch.float32)
        b = gv.gemv(x, q, s, "int8_g128", config=dict(BN=4, BK=256, MAGIC=False),
                    out_dtype=torch.float32)
        assert torch.equal(a, b)
        assert rel(a, reference(x, deq)) < TOL[torch.float32]
        w, _, wdeq = weights(9, 200, False, gen)
        x = torch.randn(1, 2, 200, generator=gen).bfloat16().to(DEV)
        for cfg in (None, dict(variant="cuda", BN=4, BK=128)):
            y = gv.gemv(x, w, None, "copy", config=cfg, out_dtype=torch.float32)
            assert y.shape == (1, 2, 9)
            assert rel(y.reshape(2, 9), reference(x.reshape(2, 200), wdeq)) < TOL[torch.float32]


def test_deterministic_and_zero_rows(gv):
    gen = torch.Generator().manual_seed(9)
    q, s, _ = weights(24, 256, True, gen)
    x = torch.randn(3, 256, generator=gen).bfloat16().to(DEV)
    with one_thread():
        a = gv.gemv(x, q, s, "int8_g128", out_dtype=torch.float32)
        assert torch.equal(a, gv.gemv(x, q, s, "int8_g128", out_dtype=torch.float32))
    assert gv.gemv(x[:0], q, s, "int8_g128").shape == (0, 24)


def test_every_table_config_runs(gv):
    """Each GEMV_TABLE config (the H200 winners) and each bf16 candidate of the cuda variant
    (what bench_gemv.py sweeps for the FP32 projections) on a small shape of its kind (BK
    capped at K; N 20 leaves a partial row block at BN 8)."""
    gen = torch.Generator().manual_seed(11)
    cfgs = {(e[0], tuple(sorted(e[4].items()))) for e in gv.GEMV_TABLE}
    cfgs |= {("bf16", tuple(sorted(c.items()))) for c in gv.GEMV_CANDIDATES["bf16"]
             if c["variant"] == "cuda" and c.get("STAGES", 1) == 1 and not c.get("PREFETCH")}
    assert cfgs
    with one_thread():
        for kind, items in sorted(cfgs):
            quant = kind == "int8"
            w, s, deq = weights(20, 256, quant, gen)
            x = torch.randn(3, 256, generator=gen).bfloat16().to(DEV)
            out = torch.bfloat16 if quant else torch.float32
            y = gv.gemv(x, w, s, "int8_g128" if quant else "bf16", config=dict(items),
                        out_dtype=out)
            assert rel(y, reference(x, deq)) < TOL[out], (kind, items)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="real shapes: compiled on CUDA only")
def test_every_table_row_at_its_own_shape(gv):
    """Each GEMV_TABLE row of kinds int8 / bf16 at its own N and K (the real decode shapes, where
    the tiny checkpoint never goes: the TP-4 CSA projection's 2,576 x 4,096 among them), at both
    ends of its M range, with its config, against the FP64 reference."""
    gen = torch.Generator().manual_seed(13)
    rows = [r for r in gv.GEMV_TABLE if r[0] in ("int8", "bf16")]
    assert any(r[1] == (2576, 2576) for r in rows)
    for kind, (n, _), (k, _), (m_lo, m_hi), cfg in rows:
        quant = kind == "int8"
        w, s, deq = weights(n, k, quant, gen)
        out = torch.bfloat16 if quant else torch.float32
        for m in sorted({m_lo, m_hi}):
            x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
            y = gv.gemv(x, w, s, "int8_g128" if quant else "bf16", config=cfg, out_dtype=out)
            assert rel(y, reference(x, deq)) < TOL[out], (kind, n, k, m, cfg)


def test_table_lookup_first_match(gv, monkeypatch):
    monkeypatch.setattr(gv, "GEMV_TABLE", [
        ("int8", (1, 2048), (1, 8192), (1, 2), dict(variant="cuda", BN=2, BK=1024)),
        ("int8", (1, 2048), (1, 8192), (1, 8), dict(BN=4, BK=512, MAGIC=False, num_warps=4))])
    assert gv.gemv_config(1, 1536, 4096, True)["variant"] == "cuda"
    assert gv.gemv_config(4, 1536, 4096, True)["BN"] == 4
    assert gv.gemv_lookup(1, 4096, 4096, True) is None                 # N out of range
    assert gv.gemv_lookup(1, 1536, 4096, False) is None                # other kind
    got = gv.gemv_config(1, 4096, 4096, True)                          # -> the default
    monkeypatch.setattr(gv, "GEMV_TABLE", [])
    assert got == gv.gemv_config(1, 4096, 4096, True)


def test_bad_input_one_line_errors(gv):
    gen = torch.Generator().manual_seed(5)
    q, s, _ = weights(16, 256, True, gen)
    x = torch.randn(2, 256, generator=gen).bfloat16().to(DEV)
    wb = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV)
    big = torch.zeros(9, 256, dtype=torch.bfloat16, device=DEV)
    for call, msg in ((lambda: gv.gemv(x.float(), q, s, "int8_g128"), "bfloat16"),
                      (lambda: gv.gemv(x[:, :128], q, s, "int8_g128"), "inputs"),
                      (lambda: gv.gemv(x, q, s[:, :1], "int8_g128"), "scales"),
                      (lambda: gv.gemv(x, q, None, "int8_mx32"), "not supported"),
                      (lambda: gv.gemv(x, wb, s, "bf16"), "no scale"),
                      (lambda: gv.gemv(big, q, s, "int8_g128"), "at most 8 rows"),
                      (lambda: gv.gemv(x, q, s, "int8_g128", out_dtype=torch.float16), "out_dtype"),
                      (lambda: gv.gemv(x, q, s, "int8_g128", config=dict(BK=192)), "BK"),
                      (lambda: gv.gemv(x, wb, None, "bf16", config=dict(MAGIC=True)), "MAGIC"),
                      (lambda: gv.gemv(x, q, s, "int8_g128", config=dict(variant="x")), "variant")):
        with pytest.raises(ValueError, match=msg):
            call()


@pytest.mark.parametrize("G, O, K, M, cfg", [
    (2, 8, 256, 1, dict(variant="cuda", BN=4, BK=128)),        # 2 programs a group, 2 K steps
    (3, 4, 384, 3, dict(variant="fma", BN=1, BK=256, num_warps=2)),   # K not a step multiple
    (2, 16, 128, 8, None)])                                     # the default config
def test_grouped_equals_the_grouped_einsum(gv, G, O, K, M, cfg):
    """gemv_grouped (the decode step's wo_a) = einsum("tgi,goi->tgo") of model.attention, to the
    BF16 output rounding; each group's rows read only their group's inputs."""
    gen = torch.Generator().manual_seed(G * O + K + M)
    w, _, deq = weights(G * O, K, False, gen)
    x = torch.randn(M, G * K, generator=gen).bfloat16().to(DEV)
    with one_thread():
        y = gv.gemv_grouped(x, w, O, config=cfg)
    want = torch.einsum("tgi,goi->tgo", x.cpu().double().view(M, G, K),
                        deq.double().view(G, O, K)).reshape(M, G * O)
    assert y.dtype == torch.bfloat16 and y.shape == (M, G * O)
    assert rel(y, want) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="groups of"):
        gv.gemv_grouped(x[:, :K], w, O)
    with pytest.raises(ValueError, match="must divide"):
        gv.gemv_grouped(x, w, O, config=dict(BN=3))
    with pytest.raises(ValueError, match=r"weight \[G\*"):
        gv.gemv_grouped(x, w, O + 1 if (G * O) % (O + 1) else O + 2)


# (n, k, config): one K step, a masked K tail over steps, double-buffered steps
NORM_CASES = [(16, 256, dict(BN=4, BK=256)), (20, 384, dict(BN=8, BK=256)),
              (12, 512, dict(BN=4, BK=128, PREFETCH=True, MAGIC=True))]


@pytest.mark.parametrize("quant", [True, False], ids=["int8_g128", "bf16"])
@pytest.mark.parametrize("n,k,cfg", NORM_CASES)
def test_gemv_norm_in_the_launch(gv, quant, n, k, cfg):
    """launch(norm=): RMSNorm(x) @ W^T in one launch = the norm's own kernel then the GEMV,
    within the GEMV's tolerance (the norm's Σx² in another order: an input may differ by one
    bf16 ulp), and against the FP64 product of the unrounded normed x within one more rounding."""
    rn = kernel_module("rope_norm", "_rms_kernel", INTERPRET)
    gen = torch.Generator().manual_seed(n + k)
    w, s, deq = weights(n, k, quant, gen)
    if not quant:
        cfg = {a: b for a, b in cfg.items() if a != "MAGIC"}
    nw = (torch.rand(k, generator=gen) + 0.5).to(DEV)
    with one_thread():
        for m in (1, 2, 5):
            x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).add(0.2)
                 * 4).bfloat16().to(DEV)
            y = gv.launch(x, w, s, quant, torch.bfloat16, config=cfg, norm=(nw, 1e-6))
            two = gv.launch(rn.rms_norm(x, nw, 1e-6), w, s, quant, torch.bfloat16, config=cfg)
            assert y.shape == (m, n) and rel(y, two) < TOL[torch.bfloat16], (m, cfg)
            xf = x.double().cpu()
            xn = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * nw.double().cpu()
            assert rel(y, xn @ deq.double().T) < 2 * TOL[torch.bfloat16], (m, cfg)
    with pytest.raises(ValueError, match="norm= needs"):
        gv.launch(x, w, s, quant, torch.bfloat16, config=dict(variant="fma", BN=2, BK=128),
                  norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="norm= needs"):
        gv.launch(x, w, s, quant, torch.bfloat16, config=cfg, norm=(nw[:-1], 1e-6))


def test_linear_forward_normed_folds_where_the_table_says(gv, monkeypatch):
    """Linear.forward_normed: one _gemv_kernel launch (no norm launch) at a GEMV_TABLE shape of
    the cuda variant, = self(norm(x)) within tolerance; the fma variant, other shapes and the
    torch backend keep the two calls."""
    import backfit.runtime.kernels as pkg
    from backfit.runtime.layers import Linear, RMSNorm
    rn = kernel_module("rope_norm", "_rms_kernel", INTERPRET)
    gen = torch.Generator().manual_seed(4)
    q, s, _ = weights(24, 256, True, gen)
    lin, norm = Linear(256, 24), RMSNorm(256, 1e-6)
    lin.load("int8_g128", q, s)
    norm.weight = (torch.rand(256, generator=gen) + 0.5).to(DEV)
    x = torch.randn(1, 256, generator=gen).bfloat16().to(DEV)
    assert not lin.norm_folds(x)                                       # torch backend
    monkeypatch.setattr(pkg, "_backend", "triton")
    monkeypatch.setattr(pkg, "_ANY_DEVICE", True)
    monkeypatch.setattr(gv, "GEMV_TABLE", [])
    assert not lin.norm_folds(x)                                       # no table row
    monkeypatch.setattr(gv, "GEMV_TABLE", [("int8", (24, 24), (256, 256), (1, 1),
                                            dict(variant="fma", BN=4, BK=256))])
    assert not lin.norm_folds(x)                                       # fma: no norm
    monkeypatch.setattr(gv, "GEMV_TABLE", [("int8", (24, 24), (256, 256), (1, 1),
                                            dict(variant="cuda", BN=4, BK=256))])
    assert lin.norm_folds(x) and not lin.norm_folds(torch.cat([x, x]))   # M = 2: no row
    calls = []
    real = rn.rms_norm
    monkeypatch.setattr(rn, "rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with one_thread():
        y = lin.forward_normed(x, norm)
        assert not calls
        want = lin(norm(x))
        assert calls and rel(y, want) < TOL[torch.bfloat16]
