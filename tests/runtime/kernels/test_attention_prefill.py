"""Query-blocked prefill attention (runtime.kernels.attention.prefill) against
kernels.ref.sparse_attention_ref over random paged pools, under the Triton interpreter on CPU.

Several sequences per call, chunks that start at 0 and mid-sequence (past the window, so ring
and in-flight keys mix inside one block), chunk lengths that BQ does not divide, one-token rows,
shuffled block tables and scattered slots: a wrong band mask, ring row, kv row, block boundary,
entry lookup or scale gives an O(1) error. Window 16, 8 heads x D 64 (BH = 8 < the default 16,
so BQ grows), H = 20 with BH 16 (a partial head block) and D 80 (padded) in FP32.
The interpreter truncates FP32->BF16 casts (int8 dequantization), so there the reference
truncates too and the tolerance is 1e-5; on a GPU the plain reference, 2e-4.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
TOL = 1e-5 if INTERPRET else 2e-4

from support import kernel_module, one_thread, truncating_pool_get

from backfit.runtime.kernels import ref

W, R, BLOCK, NB = 16, 24, 16, 96         # window, ring rows, block size (tokens), pool blocks
# (start, length) per sequence: from 0, mid-sequence past the window, one-token, ragged
CHUNKS = [(0, 11), (40, 1), (20, 19), (150, 6), (5, 9)]


@pytest.fixture(scope="module")
def pre():
    kernel_module("attention.tiles", "_rows_tile", INTERPRET)      # the tiles both kernels use
    return kernel_module("attention.prefill", "_prefill_kernel", INTERPRET)


@pytest.fixture(scope="module")
def cd(pre):
    """The column-chunked kernel's module, decorated like `pre` (its launcher imports it)."""
    return kernel_module("attention.prefill_cd", "_prefill_cd_kernel", INTERPRET)


@pytest.fixture(autouse=True)
def _truncating_reference(monkeypatch):
    if INTERPRET:
        truncating_pool_get(monkeypatch)


def pool(gen, shape, D, int8, dtype):
    if int8:
        return (torch.randint(-127, 128, (*shape, D), generator=gen, dtype=torch.int8).to(DEV),
                torch.rand(*shape, generator=gen).add(0.005).mul(0.02).to(DEV))
    return torch.randn(*shape, D, generator=gen).to(dtype).to(DEV), None


def case(seed, mode, int8, chunks=CHUNKS, ratio=4, H=8, D=64, dtype=torch.bfloat16, k=12):
    """Inputs of sparse_attention(..., seq=, start=) for `chunks`, one sequence each."""
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    NS, T = len(chunks), sum(n for _, n in chunks)
    ring, rsc = pool(gen, (NS + 3, R), D, int8, dtype)
    ent, esc = pool(gen, (NB, BLOCK // ratio), D, int8, dtype)
    free = list(range(NB))
    rnd.shuffle(free)
    need = [(s0 + n + BLOCK - 1) // BLOCK for s0, n in chunks]
    tables = torch.zeros(NS, max(need), dtype=torch.int32)
    for b, m in enumerate(need):
        tables[b, :m] = torch.tensor([free.pop() for _ in range(m)])
    pos = torch.cat([torch.arange(s0, s0 + n) for s0, n in chunks])
    sel = None
    if mode == "csa":                     # distinct j < (p+1)//ratio, -1 padded
        sel = torch.full((T, k), -1, dtype=torch.int32)
        for t, p in enumerate(pos.tolist()):
            n = min(k, (p + 1) // ratio)
            sel[t, :n] = torch.randperm((p + 1) // ratio, generator=gen)[:n].to(torch.int32)
        sel = sel.to(DEV)
    kv = torch.randn(T, D, generator=gen) * (0.5 if int8 else 1)
    comp = mode != "window"
    return dict(q=(torch.randn(T, H, D, generator=gen) * 3).to(dtype).to(DEV),
                kv=kv.to(dtype).to(DEV), pos=pos.to(DEV),
                sink=torch.randn(H, generator=gen).to(DEV), ring=ring, ring_scale=rsc,
                slots=torch.tensor(rnd.sample(range(NS + 3), NS), dtype=torch.int32).to(DEV),
                window=W, mode=mode, entries=ent if comp else None,
                entry_scale=esc if comp else None, tables=tables.to(DEV) if comp else None,
                ratio=ratio if comp else 0, sel=sel,
                seq=torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(chunks)]).to(DEV),
                start=torch.cat([torch.full((n,), s0) for s0, n in chunks]).to(DEV))


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode,ratio", [("window", 0), ("hca", 4), ("csa", 4)])
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_attention_sweep(pre, mode, ratio, int8):
    """Every mode and pool storage, three tilings of the plain kernel: BQ 4 (3 blocks in the
    11-token chunk), the sm_80 table's and the sm_90 table's tiles (csa: one query per block;
    the CD kernel: test_prefill_attention_column_chunks)."""
    c = case(10 + ratio + int8, mode, int8, ratio=max(ratio, 4))
    with one_thread():
        want = ref.sparse_attention_ref(**c)
        tables = (pre.SM80_INT8_CONFIGS if int8 else pre.SM80_CONFIGS, pre.PREFILL_CONFIGS)
        plain = [{k: v for k, v in t[mode].items() if k != "CD"} for t in tables]   # D 64
        for cfg in (dict(BQ=4, BH=8, BN=16), *plain):
            got = pre.sparse_attention_prefill(**c, config=cfg)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert rel(got, want) < TOL, (mode, int8, cfg)


@pytest.mark.parametrize("mode,ratio", [("window", 0), ("hca", 4), ("csa", 4)])
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_attention_column_chunks(pre, cd, mode, ratio, int8):
    """CD=1 (kernels.attention.prefill_cd: D in eight 16-column chunks at D 128, two programs a
    row, each its half of the columns) = the reference, at BQ 1 and (not csa) BQ 4; its BF16
    output is its FP32 output rounded, and the two halves agree on the scores (a row whose
    columns are all equal gets the same output in both halves)."""
    c = case(20 + ratio + int8, mode, int8, ratio=max(ratio, 4), D=128)
    with one_thread():
        want = ref.sparse_attention_ref(**c)
        for bq in (1,) if mode == "csa" else (1, 4):
            cfg = dict(CD=1, BQ=bq, BH=8, BN=16, num_warps=4, num_stages=2)
            got = pre.sparse_attention_prefill(**c, config=cfg)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert rel(got, want) < TOL, (mode, int8, cfg)
        if int8:
            return
        o16 = pre.sparse_attention_prefill(**c, config=cfg, out_dtype=torch.bfloat16)
        if not INTERPRET:
            assert torch.equal(o16, got.to(torch.bfloat16))
        flat = dict(c, kv=c["kv"][:, :1].expand_as(c["kv"]).contiguous(),
                    ring=c["ring"][..., :1].expand_as(c["ring"]).contiguous(),
                    entries=None if c["entries"] is None else
                    c["entries"][..., :1].expand_as(c["entries"]).contiguous())
        o = pre.sparse_attention_prefill(**flat, config=cfg)
        assert torch.equal(o[..., :64], o[..., 64:])


@pytest.mark.parametrize("mode,ratio", [("window", 0), ("csa", 4)])
def test_prefill_attention_bf16_output_is_the_fp32_output_rounded(pre, mode, ratio):
    """out_dtype=bf16 stores the FP32 output rounded (what the inverse RoPE after it reads):
    bit for bit on a GPU; the interpreter's FP32 -> BF16 cast truncates (one bf16 ulp)."""
    c = case(40 + ratio, mode, False, ratio=max(ratio, 4))
    with one_thread():
        o32 = pre.sparse_attention_prefill(**c)
        o16 = pre.sparse_attention_prefill(**c, out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and o16.shape == o32.shape
    if INTERPRET:
        torch.testing.assert_close(o16.float(), o32, rtol=8e-3, atol=1e-6)
    else:
        assert torch.equal(o16, o32.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        pre.sparse_attention_prefill(**c, out_dtype=torch.float16)


def test_blocks_of_every_size_and_padded_heads_fp32(pre):
    """HCA ratio 8 in FP32 (ieee dots), H 20 over 16-head blocks, D 80 padded to 128; BQ 1, 2, 8
    (8 > most chunks: blocks end at the chunk, not at BQ), and the CD kernel."""
    c = case(3, "hca", False, ratio=8, H=20, D=80, dtype=torch.float32)
    with one_thread():
        want = ref.sparse_attention_ref(**c)
        for bq in (1, 2, 8):
            got = pre.sparse_attention_prefill(**c, config=dict(CD=0, BQ=bq, BH=16, BN=16))
            assert rel(got, want) < 1e-5, bq
        got = pre.sparse_attention_prefill(**c, config=dict(CD=1, BQ=2, BH=16, BN=16))
        assert rel(got, want) < 1e-5, "CD"                         # D 80 in chunks of 16 of 128


def test_decode_rows_and_in_flight_keys(pre):
    """seq=None is decode (each row its own chunk, start = pos): = decode_attention_ref. In a
    chunk, keys at positions >= start come from kv, not the ring; the sink is in the
    denominator."""
    c = case(5, "window", True)
    with one_thread():
        d = {k: v for k, v in c.items() if k not in ("seq", "start")}
        d["slots"] = c["slots"][c["seq"].long()]                         # one slot per row
        assert rel(pre.sparse_attention_prefill(**d), ref.decode_attention_ref(**d)) < TOL
        base = pre.sparse_attention_prefill(**c)
        ring = c["ring"].clone()
        for b, (s0, n) in enumerate(CHUNKS):    # the chunks' own rows not holding older keys
            ring[c["slots"][b].long(), torch.arange(s0, s0 + min(n, R - W + 1)) % R] = 100
        assert torch.equal(pre.sparse_attention_prefill(**dict(c, ring=ring)), base)
        assert rel(pre.sparse_attention_prefill(**dict(c, kv=-c["kv"])), base) > 0.05
        assert rel(pre.sparse_attention_prefill(**dict(c, sink=c["sink"] + 3)), base) > 0.05


def test_blocks_list(pre):
    """A block starts at every BQ-th row of each chunk; -1 past the last block."""
    pos = torch.tensor([0, 1, 2, 3, 4, 40, 20, 21, 22])
    start = torch.tensor([0, 0, 0, 0, 0, 40, 20, 20, 20])
    got = pre.prefill_blocks(pos, start, 2, 8).tolist()
    assert got == [0, 2, 4, 5, 6, 8, -1, -1]


def test_memo_reuses_positions_and_blocks(pre):
    """memo (ForwardBatch.memo): the first call makes the int32 positions and the block list,
    a second call (another mode and tile, as the next layer) reuses the positions, makes its own
    blocks for its own tile; outputs equal the calls without a memo bit for bit."""
    memo = {}
    with one_thread():
        for mode, cfg in (("hca", dict(BQ=4, BH=8, BN=16)), ("window", dict(BQ=8, BH=8, BN=16))):
            c = case(3, mode, False)
            want = pre.sparse_attention_prefill(**c, config=cfg)
            pos32 = memo.get("pos32")
            got = pre.sparse_attention_prefill(**c, config=cfg, memo=memo)
            assert torch.equal(got, want), mode
            if pos32 is not None:
                assert memo["pos32"] is pos32                        # made once, reused
    assert sorted(k[1] for k in memo if k != "pos32") == [4, 8]


def test_bad_inputs(pre):
    c = case(9, "csa", False)
    with pytest.raises(ValueError, match="mode"):
        pre.sparse_attention_prefill(**dict(c, mode="dense"))
    with pytest.raises(ValueError, match="csa needs sel"):
        pre.sparse_attention_prefill(**dict(c, sel=None))
    with pytest.raises(ValueError, match="seq and start"):
        pre.sparse_attention_prefill(**dict(c, start=None))
    with pytest.raises(ValueError, match="int8 ring needs ring_scale"):
        pre.sparse_attention_prefill(**dict(c, ring=c["ring"].to(torch.int8)))
    with pytest.raises(ValueError, match="BN=8"):
        pre.sparse_attention_prefill(**c, config=dict(BN=8))
    with pytest.raises(ValueError, match="CD needs D >= 128"):
        pre.sparse_attention_prefill(**c, config=dict(CD=1))


# Vision-Exp image spans (IMAGE_START .. IMAGE_END positions) inside chunks 0, 2 and 3 of CHUNKS:
# one in a chunk from 0, one longer than the window in a mid-sequence chunk (its first rows mix
# ring and in-flight keys), one short one in the middle of a chunk
SPANS = {0: (2, 9), 2: (21, 38), 3: (151, 154)}


def span_of(c):
    """(lo, hi) [T] int32: a query's image span, its own position twice outside spans."""
    lo, hi = c["pos"].clone(), c["pos"].clone()
    for i, (a, b) in SPANS.items():
        m = (c["seq"] == i) & (c["pos"] >= a) & (c["pos"] <= b)
        lo[m], hi[m] = a, b
    return lo.int(), hi.int()


@pytest.mark.parametrize("mode,ratio", [("window", 0), ("hca", 4)])
def test_prefill_attention_image_spans(pre, cd, mode, ratio):
    """span= (dsv4-vision.md 11.2): every query inside an image span also sees the span's
    in-flight keys after it (and before its window), the plain and the column-chunked kernels
    alike, one and four queries a block; rows outside the spans and the entries are untouched
    (= the causal op). (The ring, int8 or not, and the CSA selections are read as without
    spans: a span's keys are all in flight.)"""
    c = case(30 + ratio, mode, False, ratio=max(ratio, 4), D=128)
    span = span_of(c)
    with one_thread():
        want = ref.sparse_attention_ref(**c, span=span)
        causal = ref.sparse_attention_ref(**c)
        for cfg in (dict(CD=0, BQ=4, BH=8, BN=16), dict(CD=1, BQ=1, BH=8, BN=16, num_warps=4,
                                                         num_stages=2)):
            got = pre.sparse_attention_prefill(**c, config=cfg, span=span)
            assert rel(got, want) < TOL, (mode, cfg)
    inside = (span[0] != c["pos"].int()) | (span[1] != c["pos"].int())
    assert rel(want[~inside], causal[~inside]) == 0
    last = torch.tensor([False] * len(inside))
    for i, (a, b) in SPANS.items():
        last |= (c["seq"] == i) & (c["pos"] == b)
    sees_more = inside & ~last                          # keys after it: another output
    d = (want - causal).flatten(1).norm(dim=1) / causal.flatten(1).norm(dim=1)
    assert d[sees_more].min() > 1e-3
    with pytest.raises(ValueError, match="span"):
        pre.sparse_attention_prefill(**c, span=(span[0][:3], span[1][:3]))
