"""Indexer kernels (runtime.kernels.indexer) against kernels.ref over random paged indexer keys.

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

from support import one_thread

from backfit.runtime.kernels import ref

BLOCK, DI = 16, 128
PB = BLOCK // 4


@pytest.fixture(scope="module")
def idx():
    import importlib

    import backfit.runtime.kernels.indexer as indexer
    if indexer._interpreted() != INTERPRET:
        indexer = importlib.reload(indexer)
    return indexer


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


@pytest.mark.parametrize("N,k,chunk", [(50, 16, 64), (300, 12, 64), (260, 4, 8),
                                       (700, 512, 1024), (37, 64, 64)])
def test_topk_select_exact(idx, N, k, chunk):
    gen = torch.Generator().manual_seed(N + k)
    B = 3
    s = torch.randn(B, N, generator=gen)
    s[0] = torch.randint(-3, 4, (N,), generator=gen).float()          # heavy ties: lower j first
    s[1, N // 2:] = float("-inf")                                     # invalid tail: -1
    s[2, : N // 3] = 0.0                                               # ReLU-like zeros
    s = s.to(DEV)
    got = idx.topk_select(s, k, chunk=chunk)
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
