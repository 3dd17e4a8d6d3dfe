"""Decode attention kernel (runtime.kernels.attention.decode) against kernels.ref over random paged
pools.

CPU: the Triton interpreter (TRITON_INTERPRET=1 set at import when there is no CUDA device).
Pools are filled with random vectors and read through shuffled block tables and scattered slots,
so a wrong ring row, block lookup, entry offset or scale gives an O(1) error. The window is 16,
so positions up to ~150 cross it and several 16-token blocks; splits 1 and several are forced.
The interpreter truncates FP32->BF16 casts (int8 dequantization), so there the reference
truncates too and the tolerance is 1e-5; on a GPU the plain reference, 2e-4 (p·V with p in two
BF16 halves, summation order).
"""

from __future__ import annotations

import copy
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

W, K_RB, BLOCK = 16, 8, 16              # window, rollback rows, block size (tokens)


@pytest.fixture(scope="module")
def attn():
    kernel_module("attention.merge", "_merged", INTERPRET)      # decode's kernel calls its parts
    return kernel_module("attention.decode", "_decode_kernel", INTERPRET)


@pytest.fixture(autouse=True)
def _truncating_reference(monkeypatch):
    if INTERPRET:
        truncating_pool_get(monkeypatch)


def pools(gen, S, NB, PB, D, int8, dtype=torch.bfloat16):
    """ring [S, W+K, D], entries [NB, PB, D] (+ FP32 scales for int8)."""
    def one(*shape):
        if int8:
            return (torch.randint(-127, 128, (*shape, D), generator=gen, dtype=torch.int8).to(DEV),
                    torch.rand(*shape, generator=gen).add(0.005).mul(0.02).to(DEV))
        return torch.randn(*shape, D, generator=gen).to(dtype).to(DEV), None
    return one(S, W + K_RB), one(NB, PB)


def tables_for(gen_py, B, lengths, NB):
    """Shuffled, disjoint block tables [B, max blocks] (padded with block 0)."""
    free = list(range(NB))
    gen_py.shuffle(free)
    need = [(p + BLOCK) // BLOCK for p in lengths]
    t = torch.zeros(B, max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        t[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    return t.to(DEV)


def case(gen, rnd, B, mode, int8, ratio=8, H=8, D=64, dtype=torch.bfloat16, k=12):
    S, NB = 12, 128
    PB = BLOCK // ratio
    (ring, rsc), (ent, esc) = pools(gen, S, NB, PB, D, int8, dtype)
    pos = torch.tensor([rnd.choice([0, 1, 5, W - 2, W - 1, W, W + 1, 37, 64, 95, 150])
                        for _ in range(B)])
    slots = torch.tensor(rnd.sample(range(S), B), dtype=torch.int32).to(DEV)
    tables = tables_for(rnd, B, pos.tolist(), NB)
    q = (torch.randn(B, H, D, generator=gen) * 3).to(dtype).to(DEV)
    kv = torch.randn(B, D, generator=gen).to(dtype).to(DEV)
    if int8:
        kv = kv * 0.5
    sink = torch.randn(H, generator=gen).to(DEV)
    sel = None
    if mode == "csa":                     # a valid selection: distinct j < (p+1)//ratio, -1 pad
        sel = torch.full((B, k), -1, dtype=torch.int32)
        for b, p in enumerate(pos.tolist()):
            n = min(k, (p + 1) // ratio)
            sel[b, :n] = torch.randperm((p + 1) // ratio, generator=gen)[:n].to(torch.int32)
        sel = sel.to(DEV)
    return dict(q=q, kv=kv, pos=pos.to(DEV), sink=sink, ring=ring, ring_scale=rsc, slots=slots,
                window=W, mode=mode, entries=None if mode == "window" else ent,
                entry_scale=None if mode == "window" else esc,
                tables=None if mode == "window" else tables, ratio=0 if mode == "window" else
                ratio, sel=sel)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode,ratio", [("window", 0), ("hca", 8), ("csa", 4)])
@pytest.mark.parametrize("int8", [False, True])
def test_decode_attention_sweep(attn, mode, ratio, int8):
    gen, rnd = torch.Generator().manual_seed(ratio * 2 + int8), random.Random(ratio + int8)
    with one_thread():
        for B, split in ((1, None), (3, 1), (9, None)):
            c = case(gen, rnd, B, mode, int8, ratio=max(ratio, 4))
            want = ref.decode_attention_ref(**c)
            got = attn.decode_attention(**c, split=split)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert rel(got, want) < TOL, (mode, int8, B, split, c["pos"].tolist())


@pytest.mark.parametrize("pairs", [None, 4])          # 4: several pair blocks a head
def test_out_rope_equals_the_rope_launch_after(attn, monkeypatch, pairs):
    """decode_attention(out_rope=...) = rope_norm.rope(o, pos, inverse, bf16) of its FP32 o: the
    merge's de-rotation (split KV, its own launch; counted: the fused merge really ran) and the
    plain rope launch (one split). Interpreter: bit for bit; GPU: the merge runs without FMA
    contraction, so o may differ by FP32 rounding, i.e. at most one bf16 ulp after the cast, in
    a few elements."""
    from backfit.runtime.kernels.rope_norm import rope
    from backfit.runtime.layers import yarn_inv_freq
    gen, rnd = torch.Generator().manual_seed(11), random.Random(5)
    f = yarn_inv_freq(16, 10000.0, None).to(DEV)
    fused, calls = attn.merge._merge_rope_kernel, []

    class Spy:                                   # counts the fused merge's launches
        def __getitem__(self, grid):
            calls.append(grid)
            return fused[grid]
    monkeypatch.setattr(attn.merge, "_merge_rope_kernel", Spy())
    if pairs:
        monkeypatch.setattr(attn, "MERGE_PAIRS", pairs)
    with one_thread():
        for B, split, merged in ((1, None, 1), (3, 1, 0), (2, 2, 1)):
            c = case(gen, rnd, B, "csa", False, ratio=4, k=40)      # 16 + 40 keys: 2 tiles
            c["pos"] = torch.tensor([150, 37, 95][:B]).to(DEV)   # rotations that matter
            want = rope(attn.decode_attention(**c, split=split), c["pos"], f, 16, inverse=True,
                        out_dtype=torch.bfloat16)
            n = len(calls)
            got = attn.decode_attention(**c, split=split, out_rope=(f, 16, torch.bfloat16))
            assert len(calls) - n == merged, (B, split)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            ulp = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            if INTERPRET or not merged:
                assert torch.equal(got, want), (B, split)
            else:
                assert int(ulp.max()) <= 1 and float((ulp > 0).float().mean()) < 0.01, (B, split)
    with pytest.raises(ValueError, match="out_rope"):
        attn.decode_attention(**c, split=2, out_rope=(f.float(), 16, torch.bfloat16))


@pytest.mark.parametrize("mode,ratio,int8", [("window", 0, True), ("hca", 8, False),
                                            ("csa", 4, True)])
def test_chunked_prefill_sweep(attn, mode, ratio, int8):
    """Chunks (start, length) crossing the window and blocks, mixed with one-token rows: in-flight
    keys come from the chunk's kv rows, older ones from the ring."""
    gen, rnd = torch.Generator().manual_seed(30 + ratio), random.Random(30 + ratio)
    chunks = [(0, 7), (40, 1), (20, 19), (150, 3), (13, 5)]
    NS, T = len(chunks), sum(n for _, n in chunks)
    c = case(gen, rnd, NS, mode, int8, ratio=max(ratio, 4))         # pools, slots for NS
    pos = torch.cat([torch.arange(s0, s0 + n) for s0, n in chunks])
    seq = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(chunks)])
    start = torch.cat([torch.full((n,), s0) for s0, n in chunks])
    c.update(pos=pos.to(DEV), q=(torch.randn(T, 8, 64, generator=gen) * 3).bfloat16().to(DEV),
             kv=(torch.randn(T, 64, generator=gen) * 0.5).bfloat16().to(DEV))
    if mode != "window":
        c["tables"] = tables_for(rnd, NS, [s0 + n for s0, n in chunks], 128)
    if mode == "csa":
        sel = torch.full((T, 12), -1, dtype=torch.int32)
        for t, p in enumerate(pos.tolist()):
            n = min(12, (p + 1) // ratio)
            sel[t, :n] = torch.randperm((p + 1) // ratio, generator=gen)[:n].to(torch.int32)
        c["sel"] = sel.to(DEV)
    extra = dict(seq=seq.to(DEV), start=start.to(DEV))
    with one_thread():
        want = ref.sparse_attention_ref(**c, **extra)
        for split in (1, None):
            assert rel(attn.sparse_attention(**c, **extra, split=split), want) < TOL, split


@pytest.mark.parametrize("live", [True, False])
def test_splits_of_live_keys_or_of_capacity_cover_every_key(attn, monkeypatch, live):
    """LIVE_SPLIT cuts each row's own keys (window ++ live entries) into the splits; off, the
    host's chunks of the pools' capacity do. Both attend to every key, for rows from position 0
    to past the window, 16-key tiles (up to 5 of them) and forced splits of 2 to 5 (empty
    splits included)."""
    monkeypatch.setattr(attn, "LIVE_SPLIT", live)
    monkeypatch.setitem(attn.DECODE_TILE, "BN", 16)
    gen, rnd = torch.Generator().manual_seed(13), random.Random(13)   # positions 0 to 150
    with one_thread():
        for mode, k, splits in (("csa", 64, (2, 3, 5)), ("hca", 12, (2, 4))):
            c = case(gen, rnd, 6, mode, False, ratio=4, k=k)
            want = ref.decode_attention_ref(**c)
            n_keys = W + (c["sel"].shape[1] if mode == "csa" else
                          c["tables"].shape[1] * (BLOCK // 4))  # as decode_attention sizes it
            for split in splits:
                assert attn.decode_config(6, 8, n_keys, 4, split)["SPLIT"] == split   # they run
                assert rel(attn.decode_attention(**c, split=split), want) < TOL, (mode, split)


@pytest.mark.parametrize("B,n_keys", [(1, 640), (1, 128 + 256), (2, 640), (8, 640), (1, 20000)])
def test_decode_split_is_capped_and_covers_the_keys(attn, B, n_keys):
    """The split count stays <= MAX_SPLIT (the CSA layer's 640 keys at batch 1 had 20 splits, a
    merge of 32-row tiles that cost ~10 us more on the H200) and the splits cover every key."""
    c = attn.decode_config(B, 64, n_keys, 132)
    assert 1 <= c["SPLIT"] <= attn.MAX_SPLIT, c
    assert c["SPLIT"] * c["CHUNK"] >= n_keys > (c["SPLIT"] - 1) * c["CHUNK"], c
    assert c["CHUNK"] % c["BN"] == 0, c


def test_heads_past_a_block_non_pow2_dim_and_fp32(attn):
    """H = 20 (two head blocks, one partial), D = 80 (padded to 128), FP32 act dtype (ieee)."""
    gen, rnd = torch.Generator().manual_seed(5), random.Random(5)
    with one_thread():
        c = case(gen, rnd, 4, "hca", False, ratio=8, H=20, D=80, dtype=torch.float32)
        want = ref.decode_attention_ref(**c)
        assert rel(attn.decode_attention(**c, split=3), want) < 1e-5


def test_sink_and_in_flight_kv_matter(attn):
    """The sink is in the denominator; the token's own kv comes from kv, not the ring."""
    gen, rnd = torch.Generator().manual_seed(7), random.Random(7)
    c = case(gen, rnd, 2, "window", True)
    base = attn.decode_attention(**c)
    assert rel(attn.decode_attention(**dict(c, sink=c["sink"] + 3)), base) > 0.05
    assert rel(attn.decode_attention(**dict(c, kv=-c["kv"])), base) > 0.05
    ring = c["ring"].clone()
    ring[c["slots"].long(), c["pos"].long() % ring.shape[1]] = 100      # the token's own row
    assert torch.equal(attn.decode_attention(**dict(c, ring=ring)), base)


def test_bad_inputs(attn):
    gen, rnd = torch.Generator().manual_seed(9), random.Random(9)
    c = case(gen, rnd, 2, "csa", False, ratio=4)
    with pytest.raises(ValueError, match="mode"):
        attn.decode_attention(**dict(c, mode="dense"))
    with pytest.raises(ValueError, match="csa needs sel"):
        attn.decode_attention(**dict(c, sel=None))
    with pytest.raises(ValueError, match="kv \\[B, D\\]"):
        attn.decode_attention(**dict(c, kv=c["kv"][:1]))
    with pytest.raises(ValueError, match="int8 ring needs ring_scale"):
        attn.decode_attention(**dict(c, ring=c["ring"].to(torch.int8)))


def _decode_run(model, kv_dtype, prompts, steps):
    """Prefill the two prompts in chunks (one step holds both), then `steps` batched decode tokens;
    -> (prefill logits [39, V], decode logits [steps, B, V]). Shuffled blocks, scattered
    slots (as tests/runtime/test_paged)."""
    from backfit.runtime.batch import ForwardBatch
    from backfit.runtime.cache.paged import PagedCache

    cache = PagedCache(model.cfg, 6, 64, BLOCK, model.dtype, kv_dtype, device=DEV)
    free = list(range(64))
    random.Random(3).shuffle(free)
    slots = [4, 1, 3][:len(prompts)]
    tables = [[] for _ in prompts]

    def batch(seqs):
        for (i, toks, start) in seqs:
            while len(tables[i]) * BLOCK < start + len(toks):
                tables[i].append(free.pop())
        return ForwardBatch.build(seqs, DEV, slots=[slots[i] for i, _, _ in seqs],
                                  block_tables=[tables[i] for i, _, _ in seqs])
    a, b = prompts                                  # chunked prefill, one step mixing two
    pre = [model(batch(seqs), cache) for seqs in
           ([(0, a[:5], 0)], [(0, a[5:], 5), (1, b[:20], 0)], [(1, b[20:], 20)])]
    gen = torch.Generator().manual_seed(4)
    out = []
    for t in range(steps):
        toks = torch.randint(0, 512, (len(prompts),), generator=gen)
        out.append(model(batch([(i, toks[i:i + 1], len(p) + t)
                                for i, p in enumerate(prompts)]), cache))
    return torch.cat(pre).cpu(), torch.stack(out).cpu()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_model_decode_on_kernels_matches_torch_path(attn, model_f32, kv_dtype, monkeypatch):
    """The tiny model (window 16, CSA 4 with indexer top-16, HCA 8) prefills in chunks and
    decodes with the kernels behind the switch: prefill and decode logits equal the torch
    path's to FP32 rounding across window wrap and entry completions; without the switch the
    kernels are never called."""
    import backfit.runtime.model.attention as attention_model
    if not INTERPRET:
        model_f32 = copy.deepcopy(model_f32).to(DEV)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen) for n in (9, 30)]
    want = _decode_run(model_f32, kv_dtype, prompts, 8)               # torch: backend unset
    import backfit.runtime.kernels.attention as room             # the model calls the room's
    calls = {"decode": 0, "chunks": 0, "prefill": 0}            # launchers; decode_attention
    dec, chunks = attn.decode_attention, attn.sparse_attention   # calls sparse_attention
    pre = room.sparse_attention_prefill

    def count(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)
    monkeypatch.setattr(room, "decode_attention", count("decode", dec))
    monkeypatch.setattr(attn, "sparse_attention", count("chunks", chunks))
    monkeypatch.setattr(room, "sparse_attention_prefill", count("prefill", pre))
    monkeypatch.setattr(attention_model, "get_kernel_backend", lambda: "triton")
    got = _decode_run(model_f32, kv_dtype, prompts, 8)
    L = model_f32.cfg.num_hidden_layers
    # prefill chunks: the query-blocked kernel; decode: decode_attention -> sparse_attention
    assert calls == {"decode": 8 * L, "chunks": 8 * L, "prefill": 3 * L}
    for g, w in zip(got, want):                                       # prefill, then decode
        err = ((g - w).norm(dim=-1) / w.norm(dim=-1)).max().item()
        assert err < 1e-4, err
