"""Indexer kernels (runtime.kernels.attention.indexer) against kernels.ref over random paged
indexer keys.

CPU: the Triton interpreter (TRITON_INTERPRET=1 set at import when there is no CUDA device).
Keys are read through shuffled block tables; positions cross several 16-token blocks (4 keys
per block) so a wrong lookup, row or validity bound shows as an O(1) score error or a -inf.
The top-k is checked exactly (indices, order, ties to the lower index, -1 padding) on scores
with forced ties, several chunks and a second reduction pass.
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

import triton  # noqa: E402  (after TRITON_INTERPRET)
from support import kernel_module, one_thread

from backfit.runtime.kernels import ref

BLOCK, DI = 16, 128
PB = BLOCK // 4


@pytest.fixture(scope="module")
def idx():
    return kernel_module("attention.indexer", "_score_kernel", INTERPRET)


def case(gen, rnd, B, H, dtype=torch.bfloat16, NB=96):
    pos = torch.tensor([rnd.choice([0, 2, 3, 4, 15, 16, 40, 63, 64, 130, 201]) for _ in range(B)])
    free = list(range(NB))
    rnd.shuffle(free)
    need = [(p + BLOCK) // BLOCK for p in pos.tolist()]
    tables = torch.zeros(B, max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    keys = torch.randn(NB, PB, DI, generator=gen).to(dtype).to(DEV)
    qI = torch.randn(B, H, DI, generator=gen).to(dtype).float().to(DEV)   # act-dtype values
    w = torch.randn(B, H, generator=gen).to(DEV) * H ** -0.5
    return qI, w, keys, tables.to(DEV), pos.to(DEV)


@pytest.mark.parametrize("H", [4, 16, 20])
def test_indexer_scores_sweep(idx, H):
    gen, rnd = torch.Generator().manual_seed(H), random.Random(H)
    with one_thread():
        for B in (1, 4, 9):
            args = case(gen, rnd, B, H)
            got, want = idx.indexer_scores(*args), ref.indexer_scores_ref(*args)
            fin = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), fin), args[4].tolist()
            assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), B
            assert (got[~fin] == float("-inf")).all()


@pytest.mark.parametrize("H", [16, 20])
def test_indexer_scores_q_rope_equals_the_rope_launch_before(idx, H):
    """indexer_scores(q_rope=...) on the indexer wq_b's raw qI = indexer_scores of rope_norm.
    rope(qI, pos, inv_freq, 64): the RoPE made in each score program, bit for bit (the rope
    kernel's ops, each product rounded alone), at positions whose rotation matters."""
    from backfit.runtime.kernels.rope_norm import rope
    from backfit.runtime.layers import yarn_inv_freq
    f = yarn_inv_freq(64, 10000.0, None).to(DEV)
    gen, rnd = torch.Generator().manual_seed(60 + H), random.Random(60 + H)
    with one_thread():
        for B in (1, 4):
            qI, w, keys, tables, pos = case(gen, rnd, B, H)
            qI = (qI * 3).bfloat16()
            want = idx.indexer_scores(rope(qI, pos, f, 64), w, keys, tables, pos)
            got = idx.indexer_scores(qI, w, keys, tables, pos, q_rope=(f, 64))
            assert torch.equal(got, want), pos.tolist()
    assert not torch.equal(idx.indexer_scores(qI, w, keys, tables, pos), want)
    with pytest.raises(ValueError, match="q_rope"):
        idx.indexer_scores(qI.float(), w, keys, tables, pos, q_rope=(f, 64))
    with pytest.raises(ValueError, match="q_rope"):
        idx.indexer_scores(qI, w, keys, tables, pos, pos, q_rope=(f, 64))


def test_indexer_scores_prefill_rows(idx):
    """Chunked prefill: query rows of 3 sequences, each row scored against its own table."""
    gen, rnd = torch.Generator().manual_seed(8), random.Random(8)
    qI, w, keys, tables, pos = case(gen, rnd, 3, 16)
    seq = torch.tensor([0, 0, 0, 1, 2, 2, 1], device=DEV)
    p = torch.tensor([5, 6, 7, 16, 2, 3, 17], device=DEV)
    tables = tables_cover(rnd, 3, 96)
    qI = torch.randn(7, 16, DI, generator=gen).bfloat16().float().to(DEV)
    w = torch.randn(7, 16, generator=gen).to(DEV)
    got = idx.indexer_scores(qI, w, keys, tables, p, seq)
    want = ref.indexer_scores_ref(qI, w, keys, tables, p, seq)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4)


def tables_cover(rnd, B, NB, n=2):
    blocks = list(range(NB))
    rnd.shuffle(blocks)
    return torch.tensor(blocks[:B * n], dtype=torch.int32).view(B, n).to(DEV)


def test_indexer_scores_fp32_keys(idx):
    gen, rnd = torch.Generator().manual_seed(3), random.Random(3)
    args = case(gen, rnd, 3, 8, dtype=torch.float32)
    got, want = idx.indexer_scores(*args), ref.indexer_scores_ref(*args)
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("N,k,chunk", [(50, 16, 64), (300, 12, 64), (260, 4, 8),
                                       (700, 512, 1024), (37, 64, 64)])
def test_topk_select_exact(idx, N, k, chunk, fast):
    gen = torch.Generator().manual_seed(N + k)
    B = 3
    s = torch.randn(B, N, generator=gen)
    s[0] = torch.randint(-3, 4, (N,), generator=gen).float()          # heavy ties: lower j first
    s[1, N // 2:] = float("-inf")                                     # invalid tail: -1
    s[2, : N // 3] = 0.0                                               # ReLU-like zeros
    s = s.to(DEV)
    got = idx.topk_select(s, k, chunk=chunk, fast=fast)
    want = ref.topk_select_ref(s, k)
    assert got.dtype == torch.int32 and got.shape == (B, k)
    assert torch.equal(got.cpu(), want.cpu()), (N, k)
    assert (got[1] >= 0).sum().item() == min(k, N // 2)


def test_scores_then_topk_is_indexer_select(idx):
    """Kernel scores + top-k pick the torch path's set (Indexer.select on gathered keys)."""
    gen, rnd = torch.Generator().manual_seed(11), random.Random(11)
    qI, w, keys, tables, pos = case(gen, rnd, 5, 16)
    sel = idx.topk_select(idx.indexer_scores(qI, w, keys, tables, pos), 16)
    for b in range(5):
        n = (int(pos[b]) + 1) // 4
        j = torch.arange(n, device=keys.device)
        kb = keys[tables[b].long()[j // PB], j % PB]
        dots = torch.einsum("hd,ed->he", qI[b], kb.float()).relu()
        score = torch.einsum("h,he->e", w[b], dots)
        want = set(score.topk(min(16, n)).indices.tolist()) if n else set()
        assert set(x for x in sel[b].tolist() if x >= 0) == want, b


def test_bad_inputs(idx):
    gen, rnd = torch.Generator().manual_seed(1), random.Random(1)
    qI, w, keys, tables, pos = case(gen, rnd, 2, 4)
    with pytest.raises(ValueError, match="indexer_scores"):
        idx.indexer_scores(qI, w[:1], keys, tables, pos)
    with pytest.raises(ValueError, match="power-of-2"):
        idx.indexer_scores(qI[..., :100], w, keys[..., :100], tables, pos)
    with pytest.raises(ValueError, match="topk_select"):
        idx.topk_select(torch.zeros(2, 5, dtype=torch.float64, device=DEV), 3)
    with pytest.raises(ValueError, match="power of two"):
        idx.topk_select(torch.zeros(2, 5, device=DEV), 3, chunk=1000)


# TOPK_FAST: _topk_pass_kernel's paths. A chunk (scores pass) or a chunk of sorted sub-chunks
# (keys pass) whose live keys (score > -inf) all lie in its first K is ranked / copied: live keys
# sorted, then the empty fill I64_MIN; any other chunk takes the bitonic top-K of all its keys
# (whose non-live tail keeps packed -inf keys), or in a keys pass with MERGE is merged (live
# keys sorted, then the fill). The fills tell the paths apart.
I64_MIN = -2 ** 63


def pack(s: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """As indexer._pack: FP32 score, index j -> int64 ordered by (score, -j)."""
    bits = s.contiguous().view(torch.int32).long()
    return (torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) << 32) | (2 ** 31 - 1 - j)


def want_chunk(keys: torch.Tensor, K: int, neg: int, merge: bool = False) -> torch.Tensor:
    live = (keys >> 32) > neg
    if live[K:].any() and not merge:                                # the bitonic top-K
        return keys.sort(descending=True).values[:K]
    top = keys[live].sort(descending=True).values[:K]
    return torch.cat((top, torch.full((K - len(top),), I64_MIN, dtype=torch.int64)))


def run_pass(idx, src, scores: bool, K: int, C: int, merge: bool = False,
             rb: int = 0) -> torch.Tensor:
    """One non-FINAL pass -> OUT [B, n_chunks·K] int64 (prefilled with 7, which no path writes)."""
    B, N = src.shape
    n_chunks = -(-N // C)
    out = torch.full((B, n_chunks * K), 7, dtype=torch.int64, device=DEV)
    rows = K // rb if scores and rb else 1                      # rank programs a chunk
    idx._topk_pass_kernel[(B, n_chunks, rows)](
        src, out, out, N, n_chunks * K, K, idx._neg_inf_key(), K=K, C=C, BJ=4, SCORES=scores,
        FINAL=False, MERGE=merge, LK=K.bit_length() - 1, RB=rb if scores else 0)
    return out


@pytest.mark.parametrize("rb", [0, 2, 4])
def test_topk_pass_paths(idx, rb):
    """Empty chunks, <= K live (prefix and not), exactly K, live past K (full), then the keys
    pass: copy where only sub-chunk 0 is live, the full top-K or the merge where sub-chunk 1 is
    too. rb: the scores pass ranks a live prefix in all K rows (0) or in RB-row blocks of it."""
    K, C, N, R = 8, 32, 64, 7
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(R, N, generator=gen)
    s[1, 3:6] = 0.5                                                  # ties
    live = torch.zeros(R, N, dtype=torch.bool)
    live[1, :5] = True                                               # chunk 0 ranked, 1 empty
    live[2, [0, 20]] = True                                          # non-prefix: full, empty
    live[3, :40] = True                                              # chunk 0 full, 1: exactly K
    live[4, [1, 4, 6, 37, 39]] = True                                # holes within the first K
    live[5, 32:64] = True                                            # chunk 0 empty, 1 full
    live[6, [0, 20, 40]] = True                                      # full, then ranked
    s = torch.where(live, s, float("-inf"))
    neg = idx._neg_inf_key()
    keys = pack(s, torch.arange(N).expand(R, N))
    out = run_pass(idx, s.to(DEV), True, K, C, rb=rb).cpu()
    for b in range(R):
        for c in range(N // C):
            assert torch.equal(out[b, c * K:(c + 1) * K],
                               want_chunk(keys[b, c * C:(c + 1) * C], K, neg)), (b, c)
    assert (out[0] == I64_MIN).all() and (out[2, :K] >> 32 == neg).any()  # both fills occur
    red = run_pass(idx, out.to(DEV), False, K, C).cpu()                 # 2 sub-chunks of K
    merged = run_pass(idx, out.to(DEV), False, K, C, merge=True).cpu()
    for b in range(R):
        assert torch.equal(red[b], want_chunk(out[b], K, neg)), b
        assert torch.equal(merged[b], want_chunk(out[b], K, neg, merge=True)), b
    assert (red[6, 3:] >> 32 == neg).all() and (merged[6, 3:] == I64_MIN).all()
    assert torch.equal(red[:, :3], merged[:, :3]) and torch.equal(merged[2], red[2])
    assert torch.equal(red[2], torch.cat((out[2, :2], torch.full((6,), I64_MIN))))  # copied
    assert (red[5, 1:] >> 32 > neg).all() and ((red[5] >> 32) > neg).sum() == K  # full top-K


@pytest.mark.parametrize("N,k,chunk,merge,cs,rb", [(150, 12, 32, True, 0, 128),
                                                   (150, 12, 32, False, 0, 0),
                                                   (150, 12, 64, True, 32, 4),
                                                   (64, 16, 64, True, 0, 4),
                                                   (5, 16, 64, True, 0, 128),
                                                   (60, 3, 8, True, 0, 2), (60, 1, 8, True, 0, 0)])
def test_topk_fast_rows_of_different_validity(idx, monkeypatch, N, k, chunk, merge, cs, rb):
    """Each row its own prefix (0, a few, exactly KP, KP+1, most, all) plus a tie-heavy row and a
    non-prefix row: the fast path, the old path and torch agree exactly (rb: TOPK_RB, the live
    prefix ranked in RB-row blocks, or in all KP rows at 0)."""
    gen = torch.Generator().manual_seed(N * k)
    KP = 1 << (k - 1).bit_length()
    n_valid = [0, 3, KP, KP + 1, N - 7, N]
    s = torch.randn(len(n_valid) + 2, N, generator=gen)
    for b, n in enumerate(n_valid):
        s[b, max(n, 0):] = float("-inf")
    s[-2] = torch.randint(-2, 3, (N,), generator=gen).float()
    s[-2, N // 2:] = float("-inf")
    s[-1, torch.rand(N, generator=gen) < 0.7] = float("-inf")          # holes everywhere
    s = s.to(DEV)
    monkeypatch.setattr(idx, "TOPK_MERGE", merge)
    monkeypatch.setattr(idx, "TOPK_SCORES_CHUNK", cs)                 # 32: scores in 32s, then 64s
    monkeypatch.setattr(idx, "TOPK_RB", rb)
    monkeypatch.setattr(idx, "TOPK_RB_BJ", 4)
    with one_thread():
        want = ref.topk_select_ref(s, k)
        fast, old = idx.topk_select(s, k, chunk, fast=True), idx.topk_select(s, k, chunk,
                                                                             fast=False)
    assert torch.equal(fast.cpu(), want.cpu()) and torch.equal(old.cpu(), want.cpu())


class _Recorder:
    """Stands in for _topk_pass_kernel: records each launch's (n keys in, C, K, MERGE)."""
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(src, out, sel, n, *args, **meta):
            self.calls.append((n, meta["C"], meta["K"], meta["MERGE"], meta["SCORES"]))
            return self.kernel[grid](src, out, sel, n, *args, **meta)
        return launch


@pytest.mark.parametrize("N,k", [(16384, 16), (4096, 16), (2048, 512), (16384, 512)])
def test_topk_keys_passes_no_wider_than_needed(idx, monkeypatch, N, k):
    """A keys pass is no wider than its keys need and merges at most TOPK_MERGE_WAYS sorted
    sub-chunks (the tiny checkpoint's top-16 at the 65K verify: 16 chunk winners of 16 each had
    run through a 2048-wide, 128-way merge whose compile took minutes); sel is still exact."""
    rec = _Recorder(idx._topk_pass_kernel)
    monkeypatch.setattr(idx, "_topk_pass_kernel", rec)
    gen = torch.Generator().manual_seed(N + k)
    s = torch.randn(1, N, generator=gen)
    s[0, N // 3:] = float("-inf")
    with one_thread():
        got = idx.topk_select(s.to(DEV), k)
    assert torch.equal(got.cpu(), ref.topk_select_ref(s, k))
    KP = max(2, 1 << (k - 1).bit_length())
    keys = [c for c in rec.calls if not c[4]]
    assert rec.calls[0][4] and keys, rec.calls                       # scores, then keys passes
    for n, C, K, merge, _ in keys:
        assert C <= max(triton.next_power_of_2(n), 2 * KP), rec.calls
        assert not merge or C // K <= idx.TOPK_MERGE_WAYS, rec.calls
    assert any(m for *_, m, _ in keys) == idx.TOPK_MERGE, rec.calls   # the merge still runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_topk_fast_real_shapes_in_a_cuda_graph(idx):
    """Top-512 over N = 8192 at decode-like prefixes, captured once in a CUDA graph (no host
    sync) and replayed on new scores: equal to the old path and to torch."""
    B, N, k = 8, 8192, 512
    s = torch.full((B, N), float("-inf"), device="cuda")
    idx.topk_select(s, k)                                             # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sel = idx.topk_select(s, k, fast=True)
    for n_valid in ([128] * B, [0, 1, 511, 512, 513, 2048, 4097, 8192]):
        new = torch.randn(B, N, device="cuda")
        new[torch.arange(N, device="cuda")[None] >= torch.tensor(n_valid, device="cuda")[:, None]] \
            = float("-inf")
        s.copy_(new)
        g.replay()
        want = ref.topk_select_ref(s, k)
        assert torch.equal(sel, want) and torch.equal(idx.topk_select(s, k, fast=False), want)
