"""Fused MoE (runtime.kernels.moe.int8) against kernels.ref, the device-side alignment, and the MoE
module's kernel path behind the switch. CPU: Triton interpreter (see test_gemm.py on tolerances)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
TOL = 2e-2 if INTERPRET else 5e-3        # interpreter: truncating fp32->bf16 casts (4 per path)

import moe_support  # noqa: E402
from moe_support import LIMIT, moe_kernels, rel, stacks, without_host_sync  # noqa: E402
from support import one_thread  # noqa: E402

from backfit.quant import quantize_int8_groups
from backfit.runtime.kernels import ref
from backfit.runtime.model import moe as moe_model



@pytest.fixture(scope="module")
def kmoe():
    return moe_kernels(INTERPRET)[0]


def mx_weight(e: int, n: int, k: int, gen: torch.Generator, lo: int = 118, hi: int = 126):
    """int8_mx32 codes 2·e2m1 and exponent bytes (bias 128) for e stacked [n, k] experts."""
    vals = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
    q = vals[torch.randint(0, 16, (e, n, k), generator=gen)]
    s = torch.randint(lo, hi, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    return q.to(DEV), s.to(DEV)


def experts(E: int, D: int, I: int, seed: int):
    return stacks(mx_weight, E, D, I, seed, (121, 129))


def routing(T: int, k: int, E: int, gen: torch.Generator):
    return moe_support.routing(T, k, E, gen, DEV)


@pytest.mark.parametrize("path,sizes", [("decode", (1, 2, 3)), ("sorted", (1, 5, 23, 130))])
def test_fused_moe_matches_reference(kmoe, path, sizes):
    E, D, I, k = 8, 128, 64, 6                            # TP-local: I = 2048 / 32
    st, gen = experts(E, D, I, seed=len(sizes))
    for T in sizes:
        x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
        idx, w = routing(T, k, E, gen)
        want = ref.moe_routed_ref(x, idx, w, *st, LIMIT)
        y = kmoe.fused_moe(x, idx, w, *st, LIMIT, path=path)
        assert y.shape == (T, D) and y.dtype == torch.float32
        assert rel(y, want) < TOL, (path, T)


def test_sorted_dequant_modes_agree(kmoe):
    """The sorted kernel's dequantizations (DEQ 0: FP32 convert; 2, the default: 192 + q as BF16
    bits, then BF16 FMAs in PTX, 4 codes a step — the interpreter runs the same steps in FP32)
    compute the same BF16 weights: equal outputs, bit for bit."""
    E, D, I, k = 8, 128, 64, 6
    st, gen = experts(E, D, I, seed=5)
    with one_thread():
        for T in (5, 40):
            x = (torch.randn(T, D, generator=gen) * 2).bfloat16().to(DEV)
            idx, w = routing(T, k, E, gen)
            cfg = dict(BM=16, BN=32, BK=64)
            y0 = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted", config=dict(cfg, DEQ=0))
            y = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted", config=dict(cfg, DEQ=2))
            assert torch.equal(y0, y), T
            assert rel(y, ref.moe_routed_ref(x, idx, w, *st, LIMIT)) < TOL
            # the down launch's own tile ("down": BN, warps; BK and the K order kept): same bits
            y2 = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted",
                                config=dict(cfg, down=dict(BN=64, num_warps=2)))
            assert torch.equal(y0, y2), T
    with pytest.raises(ValueError, match="shares BM"):
        kmoe.fused_moe(x, idx, w, *st, LIMIT, path="sorted", config=dict(cfg, down=dict(BM=32)))


@pytest.mark.parametrize("variant", ["base", "group", "magic", "fma", "prefetch"])
def test_decode_variants_match_reference(kmoe, variant):
    """Every decode GEMV variant (config "variant") at two tiles: a partial N block (D = 192 in
    BN = 128 rows), BK fitted below the request (K = 192 -> 64, I = 64), 2 and 4 warps, and
    the K loop as a cp.async pipeline (STAGES 3: same math, the interpreter ignores the depth;
    test_sm80.py compiles it)."""
    assert variant in kmoe.int8.DECODE_VARIANTS
    E, D, I, k = 8, 192, 64, 4
    st, gen = experts(E, D, I, seed=21)
    with one_thread():
        for T, cfg in ((1, dict(BN=32, BK=64)), (2, dict(BN=128, BK=256, num_warps=2)),
                       (3, dict(BN=16, BK=64, STAGES=3))):            # K loop as a pipeline
            x = (torch.randn(T, D, generator=gen) * 4).bfloat16().to(DEV)
            idx, w = routing(T, k, E, gen)
            want = ref.moe_routed_ref(x, idx, w, *st, LIMIT)
            y = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="decode",
                               config=dict(cfg, variant=variant))
            assert rel(y, want) < TOL, (variant, T, cfg)


# every int8 code (the 16 2·e2m1 values) and 8 exponent bytes, incl. 0 and 1 (subnormal scales
# 2^-128, 2^-127) and up to 231 (the decode fma variant's range: (1.5·2^23 + q)·2^(e-128) must
# stay finite): two experts [2, N, K] of codes and [2, N, K/32] of bytes
_VALS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
_EXPS = torch.tensor([0, 1, 2, 64, 118, 128, 140, 231], dtype=torch.uint8)


def _code_grid(N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, c, g = torch.arange(N)[:, None], torch.arange(K)[None, :], torch.arange(K // 32)[None, :]
    q = torch.stack((_VALS[(n + c) % 16], _VALS[(n + 3 * c) % 16]))
    s = torch.stack((_EXPS[(n + g) % 8], _EXPS[(2 * n + g + 1) % 8]))
    return q.to(DEV), s.to(DEV)


def _read_back_check(out, q, s, e_of):
    """out [K, N] = W[e_of[p]][:, p] (slot p's one-hot row) -> bit for bit q·2^(e-128) (float64,
    exact). The interpreter flushes subnormal BF16 casts: there bytes 0, 1 are skipped; on the
    GPU they are compared (tl.exp2 flushed them to 0 there until 2026-12-04: _pow2_mx now)."""
    K = out.shape[0]
    col = torch.arange(K, device=out.device)
    exp = s[e_of, :, col // 32]                                                  # [K, N] bytes
    want = q[e_of, :, col].double() * torch.exp2(exp.double() - 128)
    assert ((exp < 2) & (want != 0)).any() and (want.abs() == 12 * 2.0 ** 103).any()
    got = out.double()
    if INTERPRET:
        got, want = got[exp >= 2], want[exp >= 2]
    assert torch.equal(got, want), (got != want).nonzero()[:5].tolist()


@pytest.mark.parametrize("variant", ["base", "group", "magic", "fma", "prefetch"])
def test_decode_variants_read_every_code_and_exponent_exactly(kmoe, variant):
    """One-hot rows through the decode down-projection launch read W[ids[p]][:, p] back: every
    code under every exponent of _code_grid, bit for bit."""
    N, K = 16, 256
    q, s = _code_grid(N, K)
    ids = (torch.arange(K) % 2).to(torch.int32).to(DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    out = torch.full((K, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    one = torch.ones(K, dtype=torch.float32, device=DEV)
    with one_thread():
        kmoe.common.launch_decode(kmoe.int8._GEMV, K, N, K, dict(variant=variant, BN=16, BK=128,
                            num_warps=4, num_stages=2), (eye, ids, one, q, s, q, s, out, N, K, 1),
                            GATED=False, LIMIT=0.0)
    _read_back_check(out, q, s, ids.long())


@pytest.mark.parametrize("deq", [0, 2])
def test_sorted_dequant_reads_every_code_and_exponent_exactly(kmoe, deq):
    """The same read through the sorted down launch (block b of BM slots: expert b % 2; slot p's
    row is e_p), for each dequantization (DEQ 2: its PTX on a GPU)."""
    N, K, BM = 16, 256, 16
    q, s = _code_grid(N, K)
    block_e = (torch.arange(K // BM) % 2).to(torch.int32).to(DEV)
    slots = torch.arange(K, dtype=torch.int32, device=DEV)                     # pair p at slot p
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    out = torch.full((K, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    one = torch.ones(K, dtype=torch.float32, device=DEV)
    with one_thread():
        kmoe.int8._moe_sorted_kernel[(K // BM, 1)](eye, slots, block_e, one, q, s, q, s, out, N, K, 1,
                                              K, 2, GATED=False, LIMIT=0.0, F32=INTERPRET,
                                              BM=BM, BN=N, BK=64, DEQ=deq)
    _read_back_check(out, q, s, (slots.long() // BM) % 2)


def test_swiglu_clamps_bite_and_match(kmoe):
    """Inputs where g > L and |u| > L: the clamp matters (a missing clamp fails by far)."""
    E, D, I, k = 4, 64, 64, 2
    st, gen = experts(E, D, I, seed=9)
    x = (torch.randn(3, D, generator=gen) * 8).bfloat16().to(DEV)
    idx, w = routing(3, k, E, gen)
    w1, s1, w3, s3 = st[:4]
    g = ref.linear_ref(x, w1[0], s1[0], "int8_mx32").float()
    u = ref.linear_ref(x, w3[0], s3[0], "int8_mx32").float()
    assert (g > LIMIT).any() and (u.abs() > LIMIT).any()
    want = ref.moe_routed_ref(x, idx, w, *st, LIMIT)
    unclamped = ref.moe_routed_ref(x, idx, w, *st, 1e9)
    assert rel(unclamped, want) > 0.1
    for path in ("decode", "sorted"):
        assert rel(kmoe.fused_moe(x, idx, w, *st, LIMIT, path=path), want) < TOL


def test_align_covers_every_pair_once_in_expert_blocks(kmoe):
    gen = torch.Generator().manual_seed(2)
    for T, k, E, bm in ((1, 6, 16, 16), (37, 6, 16, 16), (130, 4, 8, 64), (5, 2, 256, 16)):
        idx = torch.randint(0, E, (T, k), generator=gen).to(DEV)
        P = T * k
        sorted_ids, block_e = kmoe.common.align(idx, E, bm)
        assert block_e.numel() == -(-P // bm) + min(E, P)
        assert sorted_ids.numel() == block_e.numel() * bm
        real = sorted_ids[sorted_ids < P].long()
        assert torch.equal(real.sort().values, torch.arange(P, device=DEV))     # each pair once
        assert ((sorted_ids == P) | (sorted_ids < P)).all()                    # else padding
        flat = idx.reshape(-1)
        used = block_e < E
        for b in torch.nonzero(used).flatten().tolist():
            pairs = sorted_ids[b * bm:(b + 1) * bm]
            pairs = pairs[pairs < P].long()
            assert pairs.numel() and (flat[pairs] == block_e[b]).all()
        blocks = (torch.bincount(flat, minlength=E) + bm - 1).div(bm, rounding_mode="floor")
        assert used.sum() == blocks.sum()
        assert not used[used.sum():].any()                                     # unused at the end


def test_bad_input_one_line_errors(kmoe):
    st, gen = experts(2, 64, 64, seed=3)
    x = torch.randn(1, 64).bfloat16().to(DEV)
    idx, w = routing(1, 2, 2, gen)
    with pytest.raises(ValueError, match="bf16"):
        kmoe.fused_moe(x.float(), idx, w, *st, LIMIT)
    with pytest.raises(ValueError, match="w3 must be"):
        kmoe.fused_moe(x, idx, w, st[0], st[1], st[2][:, :32], *st[3:], LIMIT)
    with pytest.raises(ValueError, match="idx"):
        kmoe.fused_moe(x, idx[:, :1], w, *st, LIMIT)
    with pytest.raises(ValueError, match="path"):
        kmoe.fused_moe(x, idx, w, *st, LIMIT, path="fast")


def test_unknown_decode_variant_is_a_one_line_error(kmoe):
    st, gen = experts(2, 64, 64, seed=4)
    x = torch.randn(1, 64).bfloat16().to(DEV)
    idx, w = routing(1, 2, 2, gen)
    with pytest.raises(ValueError, match=r"unknown decode variant 'fast', expected one of \["):
        kmoe.fused_moe(x, idx, w, *st, LIMIT, path="decode", config={"variant": "fast"})
    assert kmoe.int8.decode_config(4096, 6)["variant"] in kmoe.int8.DECODE_VARIANTS        # shipped table
    assert kmoe.int8.decode_config(192, 6)["BK"] == 64                                 # fitted to K


def test_down_projection_takes_its_own_decode_config(kmoe, monkeypatch):
    """config["down"] (and a table row's "down") applies to the down launch only."""
    E, D, I, k = 4, 128, 64, 2
    st, gen = experts(E, D, I, seed=6)
    x = (torch.randn(2, D, generator=gen) * 4).bfloat16().to(DEV)
    idx, w = routing(2, k, E, gen)
    seen, real = [], kmoe.common.launch_decode
    monkeypatch.setattr(kmoe.common, "launch_decode", lambda kern, P, N, K, cfg, *a, **kw:
                        seen.append((N, cfg)) or real(kern, P, N, K, cfg, *a, **kw))
    cfg = dict(variant="magic", BN=16, BK=64, down=dict(variant="prefetch", BN=32, BK=128))
    with one_thread():
        y = kmoe.fused_moe(x, idx, w, *st, LIMIT, path="decode", config=cfg)
    assert rel(y, ref.moe_routed_ref(x, idx, w, *st, LIMIT)) < TOL
    assert [(n, c["variant"], c["BN"], c["BK"]) for n, c in seen] == [
        (I, "magic", 16, 64), (D, "prefetch", 32, 128)]
    table = ((kmoe.common.DECODE_PAIRS, dict(cfg, down=dict(BN=64))),)
    assert kmoe.common.decode_config(4096, 6, table)["BN"] == 16
    assert kmoe.common.decode_config(4096, 6, table, down=True)["BN"] == 64
    assert "down" not in kmoe.common.decode_pair(4096, 2048, 6, None, table)[1]


def _moe_module(E: int, D: int, I: int, tp1_process):
    cfg = SimpleNamespace(hidden_size=D, moe_intermediate_size=I, swiglu_limit=LIMIT,
                          n_shared_experts=1, n_routed_experts=E, num_experts_per_tok=3,
                          routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", vocab_size=50,
                          vision=None)                    # a text model (ModelConfig.vision)
    m = moe_model.MoE(cfg, hashed=False)
    st, gen = experts(E, D, I, seed=5)
    for e, ex in enumerate(m.experts):
        ex.w1.load("int8_mx32", st[0][e].clone(), st[1][e].clone())
        ex.w3.load("int8_mx32", st[2][e].clone(), st[3][e].clone())
        ex.w2.load("int8_mx32", st[4][e].clone(), st[5][e].clone())
    m.gate.load("copy", torch.randn(E, D, generator=gen).bfloat16().to(DEV))
    m.gate.bias = torch.randn(E, generator=gen).to(DEV)
    sh = m.shared_experts
    for lin, (n, k) in ((sh.w1, (I, D)), (sh.w3, (I, D)), (sh.w2, (D, I))):
        q, s = quantize_int8_groups(torch.randn(n, k, generator=gen) / 8)
        lin.load("int8_g128", q.to(DEV), s.to(DEV))
    return m, gen


def test_moe_module_kernel_path_behind_switch(kmoe, tp1_process, monkeypatch):
    m, gen = _moe_module(8, 128, 128, tp1_process)
    x = (torch.randn(7, 128, generator=gen) * 2).bfloat16().to(DEV)
    tokens = torch.arange(7, device=DEV)
    torch_y = m(x, tokens)
    assert m.stacked is None                                      # switch off: nothing stacked
    assert m.prepare_kernels() and m.stacked[0].shape == (8, 128, 128)
    ptr = m.stacked[0].untyped_storage().data_ptr()
    assert all(ex.w1.weight.untyped_storage().data_ptr() == ptr for ex in m.experts)   # views
    assert torch.equal(m(x, tokens), torch_y)                     # stacking keeps the torch bits
    monkeypatch.setattr(moe_model, "get_kernel_backend", lambda: "triton")
    y = m(x, tokens)
    assert y.dtype == x.dtype and rel(y, torch_y) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shapes_and_no_host_sync(kmoe):
    E, D, I, k = 256, 4096, 512, 6                           # TP4-local experts
    st, gen = experts(E, D, I, seed=11)
    for T in (1, 8, 64, 300):
        x = torch.randn(T, D, generator=gen).bfloat16().cuda()
        idx, w = routing(T, k, E, gen)
        want = ref.moe_routed_ref(x, idx, w, *st, LIMIT)
        y = without_host_sync(lambda: kmoe.fused_moe(x, idx, w, *st, LIMIT))
        assert rel(y, want) < 5e-3, T


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["group", "magic", "fma", "prefetch"])
def test_gpu_decode_variants_real_shapes_and_no_host_sync(kmoe, variant):
    E, D, I, k = 256, 4096, 512, 6                           # TP4-local experts
    st, gen = experts(E, D, I, seed=12)
    cfg = dict(variant=variant, BN=16, BK=256 if variant == "fma" else 512, num_warps=4,
               num_stages=2)
    for T in (1, 8):
        x = torch.randn(T, D, generator=gen).bfloat16().cuda()
        idx, w = routing(T, k, E, gen)
        want = ref.moe_routed_ref(x, idx, w, *st, LIMIT)
        y = without_host_sync(lambda: kmoe.fused_moe(x, idx, w, *st, LIMIT, path="decode",
                                                     config=cfg))
        assert rel(y, want) < 5e-3, (variant, T)


def test_decode_table_rows_bound_the_intermediate_size(kmoe):
    """A row's third field bounds I (the experts' intermediate size on this rank): a TP-4 rank
    (I = 512) gets its own tiles, tp 1 (I = 2048) and an unknown I the last row; both launches
    of a pair take the same row."""
    small = dict(variant="magic", BN=2, BK=1024, down=dict(variant="base", BN=4, BK=512))
    big = dict(variant="magic", BN=8, BK=256, down=dict(variant="base", BN=16, BK=512))
    table = ((6, 512, small), (kmoe.common.DECODE_PAIRS, big))
    up, down = kmoe.common.decode_pair(4096, 512, 6, None, table)
    assert (up["BN"], up["BK"], down["BN"], down["BK"]) == (2, 1024, 4, 512)
    up, down = kmoe.common.decode_pair(4096, 2048, 6, None, table)
    assert (up["BN"], up["BK"], down["BN"], down["BK"]) == (8, 256, 16, 512)
    assert kmoe.common.decode_pair(4096, 512, 12, None, table)[0]["BN"] == 8       # P past the row
    assert kmoe.common.decode_config(4096, 6, table)["BN"] == 8                    # I unknown
    assert kmoe.int8.decode_config(4096, 6, I=512)["BN"] == 2                    # shipped TP-4 row
    assert kmoe.int8.decode_config(4096, 6, I=2048)["BN"] == 8                   # shipped tp-1 row
    from backfit.runtime.kernels.moe import mx4 as moe_mx4                                # same rule, mx4
    assert moe_mx4.decode_config(4096, 6, I=512)["variant"] == "word4d"
    assert moe_mx4.decode_config(512, 6, down=True, I=512)["BN"] == 64
    assert moe_mx4.decode_config(4096, 6)["variant"] == "mma"
