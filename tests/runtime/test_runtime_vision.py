"""The runtime's image path against the independent reference (backfit/verify/ref_vision.py) on
the tiny Vision-Exp checkpoint, FP32: the tower + aligner rows, and the logits of image prompts
(fusion before the hc expansion, bias_vl routing in every gate, the in-span bidirectional
window) in one full forward and in prefill chunks on the paged pools; the embedding cache runs
the tower once per image; the count check refuses ids and images that disagree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backfit.runtime.batch import ForwardBatch
from backfit.runtime.cache.layout import default_block_size
from backfit.runtime.cache.paged import PagedCache
from backfit.runtime.images import EmbeddingCache, batch_images
from backfit.verify import ref_vision
from backfit.verify.image_prompts import image_prompts, synthetic_png
from backfit.verify.reference import Reference
from backfit.vision import ImageCountError, prepare, splice

# FP32 on both sides, other op orders (SDPA vs an einsum softmax, batched vs per-image linears):
# measured 2.3e-7 / 4.9e-7 (tower rows) and 4.0e-7 / 4.1e-7 (logits, max |d| / max |ref|) on
# these prompts, so 1e-5 is 20x the floor; a wrong axis, bias or mask is >= 1e-3
TOL = 1e-5


@pytest.fixture(scope="module")
def conv(tiny_converted, tp1_process):
    return tiny_converted(1, "bf16", "vision")


@pytest.fixture(scope="module")
def model(conv, build_model):
    return build_model(conv)


@pytest.fixture(scope="module")
def ref(tiny_vision):
    return Reference(tiny_vision)


@pytest.fixture(scope="module")
def prompts(tiny_vision, model):
    """Two built-in image prompts: a 64x48 upscale (10 x 10 grid, one padding row less) and the
    320x400 letterboxed portrait (11 x 9: an odd row count, so a padding row)."""
    return image_prompts(tiny_vision / "tokenizer.json", model.cfg, n_images=2)


@pytest.fixture(scope="module")
def ref_logits(ref, prompts):
    return [ref.forward(torch.tensor(p.ids), images=p.images)["logits"] for p in prompts]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_tower_equals_the_reference(model, ref, prompts):
    images = [p.images[0] for p in prompts]
    got = EmbeddingCache(model).get(images)
    want = ref_vision.image_embeddings(ref.params, ref.cfg, images, ref.nx, torch.device("cpu"))
    for g, w, im in zip(got, want, images):
        assert g.shape == (im.plan.gh * im.plan.gw, model.cfg.hidden_size)
        assert rel(g, w) < TOL


def _items(p, lo=0, hi=None):
    """(tokens, start, images) of positions lo .. hi of VisionPrompt p for batch_images."""
    hi = len(p.ids) if hi is None else hi
    pairs = [(s, im) for s, im in zip(p.spans, p.images) if lo <= s.start < hi]
    return list(p.ids[lo:hi]), lo, pairs


def test_full_forward_logits_match_the_reference(model, prompts, ref_logits):
    cache = EmbeddingCache(model)
    for p, want in zip(prompts, ref_logits):
        b = ForwardBatch.build([(0, list(p.ids), 0)], images=batch_images(model, cache,
                                                                         [_items(p)]))
        got = model(b)
        assert rel(got, want) < TOL and torch.equal(got.argmax(-1), want.argmax(-1))


def test_paged_chunks_logits_match_the_reference(model, prompts, ref_logits):
    """Both prompts in one batch of the engine's paged pools, in chunks cut around the image
    blocks (one chunk ends right before a block, the next holds it whole and text after it)."""
    cfg = model.cfg
    cache = PagedCache(cfg, 2, 2 * 64, default_block_size(cfg), model.dtype, "auto", "cpu")
    emb = EmbeddingCache(model)
    cuts = [[0, p.spans[0].start, p.spans[0].start + p.spans[0].length + 37, len(p.ids)]
            for p in prompts]
    tables = [list(range(64)), list(range(64, 128))]
    out = [[], []]
    for step in range(3):
        items = [_items(p, c[step], c[step + 1]) for p, c in zip(prompts, cuts)]
        b = ForwardBatch.build([(i, t, s) for i, (t, s, _) in enumerate(items)], slots=[0, 1],
                               block_tables=tables, images=batch_images(model, emb, items))
        lg = model(b, cache)
        lo = 0
        for i, (t, _, _) in enumerate(items):
            out[i].append(lg[lo:lo + len(t)])
            lo += len(t)
    for got, want in zip(out, ref_logits):
        assert rel(torch.cat(got), want) < TOL


def test_the_tower_runs_once_per_image(model, prompts):
    """By content key: the same image again (another prompt, another position) is a hit; a
    different image with the same grid is not; eviction keeps the byte cap."""
    cache = EmbeddingCache(model)
    a = prompts[0].images[0]
    cache.get([a])
    cache.get([a, a])
    b = prepare(synthetic_png(64, 48, seed=99), model.cfg.vision)        # same size and grid
    assert b.plan == a.plan and b.key != a.key
    e_a, e_b = cache.get([a, b])
    assert cache.tower_images == 2 and not torch.equal(e_a, e_b)
    small = EmbeddingCache(model, max_bytes=e_a.numel() * 4)             # one image's rows
    small.get([a, b])
    assert len(small) == 1 and small.get([a])[0] is not None and small.tower_images == 3


def test_count_check_refuses_disagreeing_ids(model, prompts):
    """A block cut by the chunk end, a span against other ids, a stray block id in text, or
    a VisionPrompt whose ids were tampered with: ImageCountError, before any forward."""
    cache, p = EmbeddingCache(model), prompts[0]
    s = p.spans[0]
    with pytest.raises(ImageCountError, match="not whole inside"):
        batch_images(model, cache, [_items(p, 0, s.start + 5)[:2] + ([(s, p.images[0])],)])
    shifted = dataclasses.replace(s, start=s.start + 1)
    with pytest.raises(ImageCountError, match="not an image block"):
        batch_images(model, cache, [(list(p.ids), 0, [(shifted, p.images[0])])])
    with pytest.raises(ImageCountError, match="outside every image span"):
        batch_images(model, cache, [(list(p.ids[:s.start]) + [model.cfg.vocab_size + 2], 0, [])])
    other = prepare(synthetic_png(320, 400, seed=3), model.cfg.vision)   # another grid
    with pytest.raises(ImageCountError, match="embedding rows"):
        batch_images(model, cache, [(list(p.ids), 0, [(s, other)])])
    text = splice([[0, 5, 6]], model.cfg.vocab_size)
    assert batch_images(model, cache, [(list(text.ids), 0, [])]) is None
