"""4-bit fused MoE (runtime.kernels.moe.mx4, reached through kernels.moe.fused_moe) against the
torch path's MoE math on dequant_mx4 weights; the in-kernel e2m1 x 2^(e-127) decoding bit for
bit (one-hot inputs read the weights back); the MoE module's kernel path with mx4 experts.
CPU: Triton interpreter (see test_gemm.py on tolerances)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
TOL = 2e-2 if INTERPRET else 5e-3        # interpreter: truncating fp32->bf16 casts (4 per path)

import moe_support  # noqa: E402
from moe_support import LIMIT, moe_kernels, rel, stacks, without_host_sync  # noqa: E402
from support import one_thread  # noqa: E402

from backfit.quant import dequant_mx4, quantize_int8_groups  # noqa: E402
from backfit.runtime.kernels import ref  # noqa: E402
from backfit.runtime.model import moe as moe_model  # noqa: E402



@pytest.fixture(scope="module")
def kmx4():
    return moe_kernels(INTERPRET)[1]


def mx4_weight(e: int, n: int, k: int, gen: torch.Generator, lo: int = 119, hi: int = 127):
    """Random packed e2m1 bytes [e, n, k/2] and UE8M0 bytes (bias 127) [e, n, k/32]."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(lo, hi, (e, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return w.to(DEV), s.to(DEV)


def experts(E: int, D: int, I: int, seed: int):
    return stacks(mx4_weight, E, D, I, seed, (122, 130))


def moe_ref(x, idx, w, w1, s1, w3, s3, w2, s2, limit):
    """Routed part of MoE.forward's torch path (Expert.forward on Linear.dequantized weights)."""
    def lin(a, q, s):
        return F.linear(a, dequant_mx4(q, s).to(a.dtype))
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        xe = x[rows]
        h = ref.swiglu_ref(lin(xe, w1[e], s1[e]).float(), lin(xe, w3[e], s3[e]).float(), limit)
        h = h * w[rows, slot][:, None]                                # weight before w2
        y.index_add_(0, rows, lin(h.to(x.dtype), w2[e], s2[e]).float())
    return y


def routing(T: int, k: int, E: int, gen: torch.Generator):
    return moe_support.routing(T, k, E, gen, DEV)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_f64(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Packed bytes [N, K/2], exponent bytes [N, K/32] -> float64 [N, K] on the CPU, from the
    e2m1 table and 2.0 ** (e - 127) (exact in float64; shares nothing with backfit.quant)."""
    w, s = w.cpu().long(), s.cpu().double()
    nib = torch.stack((w & 15, w >> 4), -1).reshape(w.shape[0], -1)         # element 2j, 2j+1
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    return torch.where(nib >= 8, -mag, mag) * torch.repeat_interleave(2.0 ** (s - 127), 32, 1)


@pytest.mark.parametrize("path,deq", [("decode", None), ("sorted", 0), ("sorted", 2)])
def test_decoding_is_exact_for_every_code_and_exponent(kmx4, path, deq):
    """Every packed byte (so every code as low and as high nibble) under each of 8 exponents,
    0 and 1 among them (the subnormal values 2^-128 .. 6 * 2^-128), and the largest finite
    (e = 252): one-hot rows read W[ids[p]][:, p] back, which must equal the float64 value
    exactly (sorted: both dequantizations, DEQ 2's PTX on a GPU); dequant_mx4 (the torch
    path's) must too, on the CPU."""
    N, K = 16, 256                                    # 16 rows x 8 groups = 128 (hi, e) pairs
    exps = torch.tensor([0, 1, 2, 100, 127, 128, 159, 252], dtype=torch.uint8)
    q = torch.arange(N * K // 32)                     # group number
    grp = (q % 16)[:, None] * 16 + torch.arange(16)   # [128, 16] bytes: hi nibble q%16, lo 0..15
    w = torch.stack((grp.reshape(N, K // 2).to(torch.uint8),
                     grp.flip(0).reshape(N, K // 2).to(torch.uint8)))            # 2 experts
    s = torch.stack((exps[q // 16].reshape(N, K // 32), exps.flip(0)[q // 16].reshape(N, K // 32)))
    want = torch.stack([_e2m1_f64(w[e], s[e]) for e in (0, 1)])                  # [2, N, K]
    for e in (0, 1):
        assert dequant_mx4(w[e], s[e]).double().equal(want[e])                   # the torch path
    ids = torch.arange(K) % 2
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    with one_thread():
        got = kmx4.mx4_linear_pairs(eye, ids.to(DEV), w.to(DEV), s.to(DEV), path=path,
                                    config=None if deq is None else dict(DEQ=deq))
    got = got.cpu().double()
    want = want[ids, :, torch.arange(K)]                                         # [K, N]
    assert (want.abs() == 6 * 2.0 ** 125).any() and (want.abs() == 2.0 ** -128).any()
    assert want.to(torch.bfloat16).double().equal(want)                          # exact in bf16
    sub = (want != 0) & (want.abs() < 2.0 ** -126)                               # subnormal
    assert sub.any() and (~sub & (want != 0)).any()
    if INTERPRET:           # the interpreter's FP32 -> BF16 casts truncate subnormals: skipped
        got, want = torch.where(sub, 0.0, got), torch.where(sub, 0.0, want)
    assert torch.equal(got, want), (got != want).nonzero()[:5].tolist()


@pytest.mark.parametrize("path,sizes", [("decode", (1, 2, 3)), ("sorted", (1, 5, 23, 130))])
def test_fused_moe_mx4_matches_reference(kmx4, path, sizes):
    import backfit.runtime.kernels.moe as kmoe
    E, D, I, k = 8, 128, 64, 6                            # TP-local: I = 2048 / 32
    st, gen = experts(E, D, I, seed=len(sizes))
    with one_thread():
        for T in sizes:
            x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
            idx, w = routing(T, k, E, gen)
            want = moe_ref(x, idx, w, *st, LIMIT)
            y = kmoe.fused_moe(x, idx, w, *st, LIMIT, path=path)     # dispatches on uint8 w1
            assert y.shape == (T, D) and y.dtype == torch.float32
            assert rel(y, want) < TOL, (path, T)


def test_sorted_equals_the_int8_kernel_bit_for_bit(kmx4):
    """The same expert weights as mx4_e2m1 and as int8_mx32 (quant.mxfp4_to_int8: codes 2·e2m1,
    the exponent bytes as they are): the mx4 sorted kernel's DEQ 2 (BF16 pairs in input order,
    one dot a K tile) equals the int8 sorted kernel at the same tiles, bit for bit in the
    interpreter; compiled, 1-2 of 640-8,192 outputs differ by about one BF16 ulp (H200,
    2026-12-04: rel 7.6e-10 here; mx4 DEQ 0 too, and the one-hot reads of both are exact, so
    the weights are equal: not traced further, the two kernels' compiled FP32 code differs).
    DEQ 0 (two dots over even / odd inputs) within accumulation-order noise."""
    import backfit.runtime.kernels.moe as kmoe
    from backfit.quant import mxfp4_to_int8
    E, D, I, k = 8, 128, 64, 6
    st, gen = experts(E, D, I, seed=11)
    st8 = []
    for wq, sc in zip(st[::2], st[1::2]):
        pairs = [mxfp4_to_int8(wq[e].cpu(), sc[e].cpu()) for e in range(E)]
        st8 += [torch.stack([p[0] for p in pairs]).to(DEV), torch.stack([p[1] for p in pairs]).to(DEV)]
    with one_thread():
        for T, cfg in ((5, dict(BM=16, BN=32, BK=64)), (40, dict(BM=32, BN=64, BK=128))):
            x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
            idx, w = routing(T, k, E, gen)
            y8 = kmoe.fused_moe(x, idx, w, *st8, LIMIT, path="sorted", config=cfg)
            y2 = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted", config=dict(cfg, DEQ=2))
            y0 = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted", config=dict(cfg, DEQ=0))
            if INTERPRET:
                assert torch.equal(y2, y8), (T, rel(y2, y8))
            else:
                assert rel(y2, y8) < 1e-6 and (y2 != y8).float().mean() < 0.01, T
            assert rel(y0, y8) < TOL, T


def test_ragged_tiles_and_clamps(kmx4):
    """N not a multiple of BN (D = 192 in 128-row tiles), K tiles of 64, padded expert blocks,
    experts without tokens, and inputs where g > L and |u| > L (a missing clamp fails)."""
    E, D, I, k = 4, 192, 64, 2
    st, gen = experts(E, D, I, seed=9)
    x = (torch.randn(9, D, generator=gen) * 8).bfloat16().to(DEV)
    idx, w = routing(9, k, E, gen)
    with one_thread():
        g = F.linear(x, dequant_mx4(st[0][0], st[1][0]).bfloat16()).float()
        u = F.linear(x, dequant_mx4(st[2][0], st[3][0]).bfloat16()).float()
        assert (g > LIMIT).any() and (u.abs() > LIMIT).any()
        want = moe_ref(x, idx, w, *st, LIMIT)
        assert rel(moe_ref(x, idx, w, *st, 1e9), want) > 0.1
        for path, cfg in (("decode", dict(BN=128, BK=64)), ("sorted", dict(BN=128, BK=64)),
                          ("decode", None), ("sorted", None)):
            y = kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path=path, config=cfg)
            assert rel(y, want) < TOL, (path, cfg)


@pytest.mark.parametrize("variant", ["base", "prefetch", "word", "word4d", "mma"])
def test_decode_variants_exact_and_match(kmx4, variant):
    """Each decode GEMV variant (config "variant"): every byte x 8 exponents read back bit for
    bit by one-hot rows (as above; subnormals on the GPU only), and the fused MoE against the
    torch math with a partial N block (D = 192 in BN = 128), BK fitted (K = 192 -> 64)."""
    assert variant in kmx4.DECODE_VARIANTS
    N, K = 16, 256
    exps = torch.tensor([0, 1, 2, 100, 127, 128, 159, 252], dtype=torch.uint8)
    q = torch.arange(N * K // 32)
    grp = (q % 16)[:, None] * 16 + torch.arange(16)
    w = torch.stack((grp.reshape(N, K // 2), grp.flip(0).reshape(N, K // 2))).to(torch.uint8)
    s = torch.stack((exps[q // 16].reshape(N, K // 32), exps.flip(0)[q // 16].reshape(N, K // 32)))
    w, s, ids = w.to(DEV), s.to(DEV), (torch.arange(K) % 2).to(DEV)
    cfg = dict(variant=variant, BN=16, BK=128, num_warps=4, num_stages=2)
    E, D, I, k = 4, 192, 64, 3
    st, gen = experts(E, D, I, seed=31)
    x = (torch.randn(2, D, generator=gen) * 4).bfloat16().to(DEV)
    idx, rw = routing(2, k, E, gen)
    with one_thread():
        eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
        got = kmx4.mx4_linear_pairs(eye, ids, w, s, path="decode", config=cfg).float()
        want = torch.stack([dequant_mx4(w[e], s[e]) for e in (0, 1)])[ids, :, torch.arange(K)]
        y = kmx4.fused_moe_mx4(x, idx, rw, *st, LIMIT, path="decode",
                               config=dict(cfg, BN=128, BK=256, STAGES=3))   # 3 K steps
        y_want = moe_ref(x, idx, rw, *st, LIMIT)
    sub = (want != 0) & (want.abs() < 2.0 ** -126)                 # not compared (see above)
    got, want = torch.where(sub, 0.0, got), torch.where(sub, 0.0, want)
    assert sub.any() and torch.equal(got, want), (got != want).nonzero()[:5].tolist()
    assert rel(y, y_want) < TOL


@pytest.mark.parametrize("variant,tile,D", [("word", (16, 512, 4, 2), 512),
                                            ("word4d", (4, 512, 1, 2), 512),
                                            ("mma", (32, 512, 2, 2), 512),
                                            ("mma", (32, 1024, 4, 2), 1024)])
def test_packed_decode_variants_fused_t1_to_3(kmx4, variant, tile, D):
    """The packed-word variants through the fused MoE at T = 1..3 against the torch
    math: gate/up K = D (mma: 16 groups = its 16 rows at BK 512, 32 rows at BK 1024), down K = I
    = 128 (BK fitted to 128: 4 of the 16 rows carry a group)."""
    E, I, k = 6, 128, 3
    st, gen = experts(E, D, I, seed=41)
    bn, bk, nw, ns = tile
    cfg = dict(variant=variant, BN=bn, BK=bk, num_warps=nw, num_stages=ns)
    with one_thread():
        for T in (1, 2, 3):
            x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
            idx, w = routing(T, k, E, gen)
            y = kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path="decode", config=cfg)
            assert rel(y, moe_ref(x, idx, w, *st, LIMIT)) < TOL, (variant, tile, T)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="a real shape: compiled on CUDA only")
def test_shipped_tp4_batch1_row_at_its_shape(kmx4):
    """DECODE_TABLE's TP-4 batch-1 row (word4d gate/up, mma down) at a TP-4 rank's expert shape
    (D = 4096, I = 512, top-6 at T = 1: the launches one decode step of the slice makes) against
    the torch math, and the same as the other word variant within FP32 summation order."""
    E, D, I, k = 8, 4096, 512, 6
    st, gen = experts(E, D, I, seed=51)
    assert kmx4.decode_config(D, k, I=I)["variant"] == "word4d"
    x = (torch.randn(1, D, generator=gen) * 2).bfloat16().to(DEV)
    idx, w = routing(1, k, E, gen)
    y = kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path="decode")
    assert rel(y, moe_ref(x, idx, w, *st, LIMIT)) < TOL
    word = dict(variant="word", BN=4, BK=512, num_warps=1, num_stages=2)
    assert rel(y, kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path="decode", config=word)) < 1e-5


def test_bad_input_one_line_errors(kmx4):
    st, gen = experts(2, 64, 64, seed=3)
    x = torch.randn(1, 64).bfloat16().to(DEV)
    idx, w = routing(1, 2, 2, gen)
    with pytest.raises(ValueError, match="bf16"):
        kmx4.fused_moe_mx4(x.float(), idx, w, *st, LIMIT)
    with pytest.raises(ValueError, match=r"w3 must be contiguous torch.uint8\[2, 64, 32\]"):
        kmx4.fused_moe_mx4(x, idx, w, st[0], st[1], st[2][:, :32], *st[3:], LIMIT)
    with pytest.raises(ValueError, match=r"s2 must be"):
        kmx4.fused_moe_mx4(x, idx, w, *st[:5], st[5].view(torch.int8), LIMIT)
    with pytest.raises(ValueError, match="x has 128 inputs, experts 64"):
        kmx4.fused_moe_mx4(torch.zeros(1, 128).bfloat16().to(DEV), idx, w, *st, LIMIT)
    with pytest.raises(ValueError, match="path"):
        kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path="fast")


def test_moe_module_takes_the_kernel_path_with_mx4_experts(kmx4, tp1_process, monkeypatch):
    E, D, I = 8, 128, 128
    cfg = SimpleNamespace(hidden_size=D, moe_intermediate_size=I, swiglu_limit=LIMIT,
                          n_shared_experts=1, n_routed_experts=E, num_experts_per_tok=3,
                          routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", vocab_size=50,
                          vision=None)                    # a text model (ModelConfig.vision)
    m = moe_model.MoE(cfg, hashed=False)
    st, gen = experts(E, D, I, seed=5)
    for e, ex in enumerate(m.experts):
        for j, lin in enumerate((ex.w1, ex.w3, ex.w2)):
            lin.load("mx4_e2m1", st[2 * j][e].clone(), st[2 * j + 1][e].clone())
    m.gate.load("copy", torch.randn(E, D, generator=gen).bfloat16().to(DEV))
    m.gate.bias = torch.randn(E, generator=gen).to(DEV)
    sh = m.shared_experts
    for lin, (n, k) in ((sh.w1, (I, D)), (sh.w3, (I, D)), (sh.w2, (D, I))):
        q, s = quantize_int8_groups(torch.randn(n, k, generator=gen) / 8)
        lin.load("int8_g128", q.to(DEV), s.to(DEV))
    x = (torch.randn(7, D, generator=gen) * 2).bfloat16().to(DEV)
    tokens = torch.arange(7, device=DEV)
    with one_thread():
        torch_y = m(x, tokens)
        assert m.stacked is None                                  # switch off: nothing stacked
        assert m.prepare_kernels()
        w1 = m.stacked[0]
        assert w1.dtype == torch.uint8 and w1.shape == (E, I, D // 2)
        assert m.stacked[1].shape == (E, I, D // 32) and m.stacked[4].shape == (E, D, I // 2)
        ptr = w1.untyped_storage().data_ptr()
        assert all(ex.w1.weight.untyped_storage().data_ptr() == ptr for ex in m.experts)  # views
        assert torch.equal(m(x, tokens), torch_y)                 # stacking keeps the torch bits
        monkeypatch.setattr(moe_model, "get_kernel_backend", lambda: "triton")
        import backfit.runtime.kernels.moe as kpkg              # fused_moe's dispatch
        calls, real = [], kpkg.fused_moe_mx4
        monkeypatch.setattr(kpkg, "fused_moe_mx4", lambda *a, **kw: calls.append(1) or
                            real(*a, **kw))
        y = m(x, tokens)
    assert calls == [1]                                           # the 4-bit kernel ran
    assert y.dtype == x.dtype and rel(y, torch_y) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shapes_and_no_host_sync(kmx4):
    import backfit.runtime.kernels.moe as kmoe
    E, D, I, k = 256, 4096, 512, 6                           # TP4-local experts
    st, gen = experts(E, D, I, seed=11)
    for T in (1, 8, 64, 300):
        x = torch.randn(T, D, generator=gen).bfloat16().cuda()
        idx, w = routing(T, k, E, gen)
        want = moe_ref(x, idx, w, *st, LIMIT)
        y = without_host_sync(lambda: kmoe.fused_moe(x, idx, w, *st, LIMIT))
        assert rel(y, want) < 5e-3, T


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", [dict(variant="prefetch", BN=16, BK=1024, num_warps=4,
                                      num_stages=2),
                                 dict(variant="word", BN=16, BK=1024, num_warps=4, num_stages=2),
                                 dict(variant="mma", BN=16, BK=512, num_warps=1, num_stages=2),
                                 dict(variant="mma", BN=64, BK=512, num_warps=4, num_stages=2)])
def test_gpu_decode_variants_real_shapes_and_no_host_sync(kmx4, cfg):
    """Compiled variants (the mma one on BF16 tensor cores, whose ±0.5 codes enter the MMA as
    BF16 subnormals: the one-hot exactness test above checks those on the GPU) at real shapes."""
    E, D, I, k = 256, 4096, 512, 6                           # TP4-local experts
    st, gen = experts(E, D, I, seed=13)
    for T in (1, 8):
        x = torch.randn(T, D, generator=gen).bfloat16().cuda()
        idx, w = routing(T, k, E, gen)
        want = moe_ref(x, idx, w, *st, LIMIT)
        y = without_host_sync(lambda: kmx4.fused_moe_mx4(x, idx, w, *st, LIMIT, path="decode",
                                                         config=cfg))
        assert rel(y, want) < 5e-3, T
