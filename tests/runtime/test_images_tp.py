"""The vision tower's work shared across TP ranks (runtime/images.py): the assignment of a step's
missing images to ranks, the padded all-gather of variable-length rows (distributed.py), and
the embedding cache at tp 2 (gloo on CPU, one process per rank, the tiny Vision-Exp checkpoint
in FP32): every rank caches the same bits, each ran the tower on its share only, and the rows
match the tp 1 tower's (another grouping of images per tower call, so within a float32
tolerance, never bit-for-bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from backfit.runtime.distributed import all_gather_rows, free_port
from backfit.runtime.images import EmbeddingCache, assign_ranks
from backfit.runtime.model.vision import image_embeddings
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import prepare

# FP32 tower rows, the same images grouped otherwise per call (test_runtime_vision.py measured
# ~5e-7 between wholly different op orders); a wrong image's rows or a row shift is >= 1e-2
TOL = 1e-5
# (width, height, seed): four grids, the first image twice in step 1 (one content key)
STEP1 = ((64, 48, 0), (320, 400, 1), (64, 48, 0), (900, 300, 2), (200, 520, 3), (64, 48, 4))
STEP2 = ((320, 400, 1), (500, 500, 5))          # one hit, one new image: rank 1 gets none
# (rows per rank, trailing shape, dtype) of the all-gather cases; zero rows on either side
GATHER = (((3, 0), (4,), torch.bfloat16), ((0, 2), (2, 3), torch.float32),
          ((0, 0), (4,), torch.float32), ((2, 5), (), torch.int64), ((1, 4), (8,), torch.bfloat16))


def test_assign_ranks_balances_patches():
    n = [50, 10, 40, 30, 30, 20, 5]
    owner = assign_ranks(n, 3)
    assert owner == assign_ranks(n, 3) and len(owner) == len(n)     # one rank per image
    assert owner == [0, 0, 1, 2, 2, 1, 0]        # 50->0, 40->1, 30->2, 30->2, 20->1, 10->0, 5->0
    load = [sum(p for p, o in zip(n, owner) if o == r) for r in range(3)]
    assert load == [65, 60, 60]
    assert assign_ranks([7, 7, 7], 2) == [0, 1, 0]                  # ties: the lowest rank
    assert assign_ranks([9], 4) == [0] and assign_ranks([], 2) == []  # ranks 1-3 get none
    assert assign_ranks([100, 1, 1, 1], 2) == [0, 1, 1, 1]


def _rows(case: int, rank: int, n: int, tail: tuple, dtype) -> torch.Tensor:
    """Rank `rank`'s rows of gather case `case` (any rank can rebuild them)."""
    g = torch.Generator().manual_seed(100 * case + rank)
    if dtype.is_floating_point:
        return torch.randn((n, *tail), generator=g).to(dtype)
    return torch.randint(-2**62, 2**62, (n, *tail), generator=g, dtype=dtype)


def _gather_worker(rank: int, size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    from backfit.runtime.distributed import destroy_distributed, init_distributed
    init_distributed(rank, size, port)
    try:
        got = [all_gather_rows(_rows(c, rank, sizes[rank], tail, dt), list(sizes))
               for c, (sizes, tail, dt) in enumerate(GATHER)]
        torch.save(got, f"{out}/gather{rank}.pt")
    finally:
        destroy_distributed()


def test_all_gather_rows_on_two_ranks(tmp_path, tp1_process):
    x = torch.ones(2, 3)
    assert all_gather_rows(x, [2])[0] is x                          # tp 1: x itself
    with pytest.raises(ValueError, match="rows"):
        all_gather_rows(x, [3])
    mp.spawn(_gather_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"gather{rank}.pt")
        for c, (sizes, tail, dt) in enumerate(GATHER):
            want = [_rows(c, r, n, tail, dt) for r, n in enumerate(sizes)]
            assert [g.shape for g in got[c]] == [w.shape for w in want], (rank, c)
            assert all(g.dtype == dt and torch.equal(g, w) for g, w in zip(got[c], want)), \
                (rank, c)


def _images(vc, spec) -> list:
    return [prepare(synthetic_png(w, h, seed=s), vc) for w, h, s in spec]


def _tower_worker(rank: int, size: int, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    from backfit.config import ModelConfig
    from backfit.runtime.distributed import destroy_distributed, init_distributed
    from backfit.runtime.loader import load_model
    from backfit.runtime.model.transformer import Transformer
    init_distributed(rank, size, port)
    try:
        model = Transformer(ModelConfig.from_file(Path(root) / "config.json"), torch.float32)
        load_model(model, root)
        cache, vc = EmbeddingCache(model), model.cfg.vision
        steps = [cache.get(_images(vc, STEP1))]
        ran1 = cache.tower_ran
        steps.append(cache.get(_images(vc, STEP2)))
        torch.save({"steps": steps, "images": cache.tower_images, "ran": (ran1, cache.tower_ran),
                    "len": len(cache)}, f"{out}/tower{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def model1(tiny_converted, build_model):
    return build_model(tiny_converted(1, "bf16", "vision"))


def test_tp1_runs_every_image_as_before(model1, monkeypatch):
    """tp 1: one image_embeddings call over all missing images, in order (the tower's grouping
    unchanged), and the cache holds what that call returns."""
    from backfit.runtime import images
    calls, real = [], images.image_embeddings

    def spy(tower, aligner, ims, dtype, device):
        calls.append([im.key for im in ims])
        return real(tower, aligner, ims, dtype, device)
    monkeypatch.setattr(images, "image_embeddings", spy)
    ims = _images(model1.cfg.vision, STEP1)
    cache = EmbeddingCache(model1)
    got = cache.get(ims)
    uniq = list({im.key: im for im in ims}.values())
    assert calls == [[im.key for im in uniq]]
    want = dict(zip([im.key for im in uniq], image_embeddings(
        model1.vision, model1.aligner, uniq, model1.dtype, model1.embed.weight.device)))
    assert all(torch.equal(g, want[im.key]) for g, im in zip(got, ims))
    assert cache.tower_images == cache.tower_ran == len(uniq) == 5


def test_tp2_ranks_share_the_tower(model1, tiny_converted, tmp_path):
    vc = model1.cfg.vision
    ims1, ims2 = _images(vc, STEP1), _images(vc, STEP2)
    assert len({im.plan for im in ims1 + ims2}) >= 4                # several grids and sizes
    root = tiny_converted(2, "bf16", "vision")
    mp.spawn(_tower_worker, args=(2, free_port(), str(root), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"tower{r}.pt") for r in range(2))
    for a, b in zip(r0["steps"], r1["steps"]):                     # the ranks agree, bitwise
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # step 1: 5 distinct images of 768, 775, 1430, 765, 768 patches: rank 0 runs the 1430 and
    # the last 768, rank 1 the other three; step 2: the one new image on rank 0, none on rank 1
    assert r0["images"] == r1["images"] == 6 and r0["len"] == r1["len"] == 6
    assert (r0["ran"], r1["ran"]) == ((2, 3), (3, 3))
    cache = EmbeddingCache(model1)
    for ims, got in zip((ims1, ims2), r0["steps"]):
        for g, w, im in zip(got, cache.get(ims), ims):
            assert g.dtype == w.dtype == torch.float32
            assert g.shape == w.shape == (im.plan.gh * im.plan.gw, model1.cfg.hidden_size)
            assert ((g - w).abs().max() / w.abs().max()).item() < TOL
