"""The LM side of an image prompt in the reference (dsv4-vision.md section 11): bias_vl routing
goldens with mixed text/image rows in a hash and a scored layer, the prefill visibility masks
of two images against the section 11.2 rule, the window bounds inside sparse_attention, the
compressed / indexer branches left causal, and the whole path end to end on the tiny model."""

from __future__ import annotations

import pytest
import torch

from backfit.config import ModelConfig
from backfit.verify import ref_attention, ref_blocks, ref_vision
from backfit.verify.image_prompts import synthetic_png
from backfit.verify.ref_blocks import route
from backfit.verify.reference import Reference
from backfit.vision import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, prepare,
                            splice)
from backfit.synthetic import tiny_config_dict
from support import VISION_DIMS, one_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    """tiny_vision's config, without writing the checkpoint (the tests that need weights ask
    for tiny_vision)."""
    return ModelConfig.from_dict(tiny_config_dict("vision", vocab_size=512, **VISION_DIMS))


# ---- (d) router goldens ------------------------------------------------------------------------
TEXT_SET, IMAGE_SET = {0, 1, 2, 3, 4, 5}, {2, 3, 4, 5, 6, 7}    # forced by bias / bias_vl


def _router(cfg):
    """8 experts, top 6: `bias` forces experts 0-5 and `bias_vl` 2-7 into every selection, so
    the goldens are known sets; tid2eid[0] (the row an image id must not use) is 0-5."""
    V, E, H = cfg.vocab_size, cfg.n_routed_experts, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(V)])
    tid2eid[0] = torch.arange(6)
    bias, bias_vl = torch.zeros(E), torch.zeros(E)
    bias[list(TEXT_SET)], bias_vl[list(IMAGE_SET)] = 50.0, 50.0
    P = {"ffn.gate.weight": torch.randn(E, H, generator=g) / 8, "ffn.gate.bias": bias,
         "ffn.gate.bias_vl": bias_vl, "ffn.gate.tid2eid": tid2eid}
    # text, then every block type (lead pad, start, image, newline, tail pad, end), then text
    ids = torch.tensor([3, 0, 7] + [V + t for t in (IMAGE_PAD, IMAGE_START, IMAGE, IMAGE,
                                                    IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_END)] + [11])
    return P, ids, torch.randn(len(ids), H, generator=g)


@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "scored"])
def test_router_goldens_mixed_rows(cfg, hashed):
    P, ids, x = _router(cfg)
    rows = ref_vision.image_rows(ids, cfg)
    idx, w = route(x, ids, P, cfg, hashed, is_image=rows.is_image)
    V = cfg.vocab_size
    for r, t in enumerate(ids.tolist()):
        if t >= V:
            want = IMAGE_SET                              # all five types, hash layers too
        else:
            want = set(P["ffn.gate.tid2eid"][t].tolist()) if hashed else TEXT_SET
        assert set(idx[r].tolist()) == want, (r, t)
    s = torch.sqrt(torch.nn.functional.softplus(x @ P["ffn.gate.weight"].T))
    want_w = s.gather(1, idx) / s.gather(1, idx).sum(1, keepdim=True) * 1.5   # no bias in it
    assert torch.allclose(w, want_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "scored"])
def test_router_with_no_image_rows_is_the_text_router(cfg, hashed):
    P, ids, x = _router(cfg)
    keep = ids < cfg.vocab_size
    text, x = ids[keep], x[keep]
    a = route(x, text, P, cfg, hashed, is_image=torch.zeros(len(text), dtype=torch.bool))
    del P["ffn.gate.bias_vl"]                             # the text path never reads it
    b = route(x, text, P, cfg, hashed)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- (e) visibility masks ----------------------------------------------------------------------
def _rule(ids, V, window, max_tokens):
    """Section 11.2 as prose: a query in a span [IMAGE_START a, IMAGE_END b] sees keys
    [min(i - window + 1, i - left), i + right] with left = min(i - a, max - 1), right =
    min(b - i, max); any other query the causal window [i - window + 1, i]; within [0, S)."""
    S = len(ids)
    M = torch.zeros(S, S, dtype=torch.bool)
    span = {}
    a = None
    for i, t in enumerate(ids):
        if t == V + IMAGE_START:
            a = i
        if t == V + IMAGE_END:
            for j in range(a, i + 1):
                span[j] = (a, i)
    for i in range(S):
        lo, hi = i - window + 1, i
        if i in span:
            a, b = span[i]
            left, right = min(i - a, max_tokens - 1), min(b - i, max_tokens)
            lo, hi = min(lo, i - left), i + right
        M[i, max(0, lo):min(S, hi + 1)] = True
    return M


def _mask(ids, V, window, max_tokens):
    left, right = ref_vision.image_visibility(torch.tensor(ids), V, max_tokens)
    first, last = ref_vision.window_bounds(left, right, window, max_tokens)
    k = torch.arange(len(ids))
    return (k[None, :] >= first[:, None]) & (k[None, :] <= last[:, None])


@pytest.fixture(scope="module")
def two_images(cfg):
    """512x512 (a 198-position block, longer than the real 128 window) and 632x842 (378 pad-free,
    381 with its lead pad: the largest block the budget allows, next to the 384 clamp)."""
    imgs = [prepare(synthetic_png(512, 512, 0), cfg.vision),
            prepare(synthetic_png(632, 842, 1), cfg.vision)]
    p = splice([[1] * 9, imgs[0], [2] * 3, imgs[1], [3] * 7], cfg.vocab_size)
    assert [s.length for s in p.spans] == [200, 381]
    return p


@pytest.mark.parametrize("window", [128, 16])
def test_visibility_mask_two_images(two_images, cfg, window):
    ids, V = list(two_images.ids), cfg.vocab_size
    M = _mask(ids, V, window, 384)
    assert torch.equal(M, _rule(ids, V, window, 384))
    a, b = two_images.spans[1].span_start, two_images.spans[1].span_end
    assert M[a, b] and M[b, a] and not M[a - 1, a]        # in-span both ways; the pad: causal
    assert M[b + 1].sum() == min(window, b + 2)           # text after the span: causal window


def test_visibility_clamps_an_overlong_span(cfg):
    """A span longer than max_tokens (not producible by splice): left clamps at 383, right at 384
    (the reference's get_image_visible) and the width at window + 384."""
    V = cfg.vocab_size
    ids = [5] * 20 + [V + IMAGE_START] + [V + IMAGE] * 500 + [V + IMAGE_END] + [6] * 3
    M = _mask(ids, V, 128, 384)
    assert torch.equal(M, _rule(ids, V, 128, 384))
    i = 20 + 450                                          # deep inside: 450 after IMAGE_START
    assert M[i].nonzero().min() == i - 383 and M[20].nonzero().max() == 20 + 384


def test_unpaired_spans_are_refused(cfg):
    V = cfg.vocab_size
    with pytest.raises(ValueError, match="do not pair up"):
        ref_vision.image_visibility(torch.tensor([V + IMAGE_START, 5, V + IMAGE_START]), V, 384)


def test_sparse_attention_honours_the_bounds(two_images, cfg, monkeypatch):
    """sparse_attention with bounds == a dense softmax over exactly the mask's keys (+ sink)."""
    monkeypatch.setattr(ref_attention, "QUERY_CHUNK", 37)     # bounds cross chunk edges
    ids = torch.tensor(two_images.ids)
    rows = ref_vision.image_rows(ids, cfg)
    S, nh, D = len(ids), 2, 16
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(S, nh, D, generator=g), torch.randn(S, D, generator=g)
    sink = torch.randn(nh, generator=g)
    out = ref_attention.sparse_attention(q, kv, None, None, sink, cfg.sliding_window, rows.window)
    k = torch.arange(S)
    M = (k[None] >= rows.window[0][:, None]) & (k[None] <= rows.window[1][:, None])
    logits = torch.einsum("shd,td->sht", q, kv) * D ** -0.5
    logits = torch.cat([logits.masked_fill(~M[:, None], float("-inf")),
                        sink.view(1, nh, 1).expand(S, nh, 1)], -1)
    want = torch.einsum("sht,td->shd", logits.softmax(-1)[..., :-1], kv)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("layer", [2, 3], ids=["csa_indexer", "hca"])
def test_compressed_and_indexer_stay_causal(tiny_vision, cfg, two_images, layer, monkeypatch):
    """Only the window changes with images: the compressed entries each query may use (the
    indexer's top-k for CSA, all completed entries for HCA) are those of the same x as text."""
    seen = []
    real = ref_attention.sparse_attention

    def spy(q, kv, comp, comp_ok, sink, window, bounds=None):
        seen.append((comp_ok(0, q.shape[0]), bounds))
        return real(q, kv, comp, comp_ok, sink, window, bounds)

    monkeypatch.setattr(ref_attention, "sparse_attention", spy)
    ref = Reference(tiny_vision)
    P = ref.params(f"layers.{layer}.")
    ids = torch.tensor(two_images.ids)
    x = torch.randn(len(ids), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    rows = ref_vision.image_rows(ids, cfg)
    with_img = ref_attention.attention(x, P, cfg, cfg.ratio(layer), ref.nx, rows.window)
    text = ref_attention.attention(x, P, cfg, cfg.ratio(layer), ref.nx)
    (ok_img, bounds), (ok_text, none) = seen
    assert bounds is rows.window and none is None
    assert torch.equal(ok_img, ok_text) and ok_img.any()
    p = torch.arange(len(ids))[:, None]
    assert not (ok_img & (torch.arange(ok_img.shape[1])[None] >= (p + 1) // cfg.ratio(layer))).any()
    a, b = two_images.spans[0].span_start, two_images.spans[0].span_end
    scale = text.abs().max()
    assert torch.allclose(with_img[:a], text[:a], rtol=0, atol=1e-6 * scale)   # before: as text
    assert (with_img[a:b] - text[a:b]).abs().max() > 1e-3 * scale          # in span: wider


# ---- end to end on the tiny Vision-Exp checkpoint ------------------------------------------------
@pytest.fixture(scope="module")
def prompt(cfg):
    img = prepare(synthetic_png(320, 400, 2), cfg.vision)            # 11 x 9 grid, 122 (+ lead)
    return splice([[0, 40, 41, 42, 43, 44], img, [45, 46, 47]], cfg.vocab_size)


def test_image_rows_route_by_bias_vl_in_every_layer(tiny_vision, prompt, monkeypatch):
    """Every MoE gate, hash layers 0-2 included, gets the image rows: all five block types."""
    got = []
    real = ref_blocks.route

    def spy(x, tokens, P, cfg, hashed, stats=None, is_image=None):
        got.append((hashed, is_image))
        return real(x, tokens, P, cfg, hashed, stats, is_image)

    monkeypatch.setattr(ref_blocks, "route", spy)
    ref = Reference(tiny_vision)
    ref.forward(prompt.ids, images=prompt.images)
    span = prompt.spans[0]
    want = torch.zeros(len(prompt.ids), dtype=torch.bool)
    want[span.start:span.start + span.length] = True
    layers = range(ref.cfg.num_hidden_layers)
    assert [h for h, _ in got] == [ref.cfg.is_hash_layer(i) for i in layers]
    assert all(m is not None and torch.equal(m, want) for _, m in got)


def test_in_span_positions_see_later_image_rows(tiny_vision, prompt, monkeypatch):
    """Change only the aligner row of the LAST IMAGE slot: after layer 0 every position of the
    span (IMAGE_START included) moves, the text and the leading pad before it do not."""
    ref = Reference(tiny_vision)
    base = ref.forward(prompt.ids, images=prompt.images, capture=True)["hidden"][0]
    real = ref_vision.image_embeddings
    last = prompt.images[0].block.perm[-1]

    def nudged(*a, **k):
        rows = real(*a, **k)
        rows[0][last] += 3.0
        return rows

    monkeypatch.setattr(ref_vision, "image_embeddings", nudged)
    h = ref.forward(prompt.ids, images=prompt.images, capture=True)["hidden"][0]
    span = prompt.spans[0]
    a, b = span.span_start, span.span_end
    diff = (h - base).flatten(1).norm(dim=1) / base.flatten(1).norm(dim=1)    # per position
    assert span.lead == 1 and (diff[:a] == 0).all()                           # text + lead pad
    assert (diff[a:b + 1] > 1e-4).all()                                       # the whole span


def test_reference_pass_takes_image_prompts(tiny_vision, cfg):
    """`backfit verify`'s reference pass on built-in image prompts (image_prompts.py): one logit
    row per position, and the text before each image exactly as in a text-only forward of it."""
    from backfit.verify.image_prompts import image_prompts
    from backfit.verify.run import _reference_pass
    seqs = image_prompts(tiny_vision / "tokenizer.json", cfg, n_images=2)
    assert [len(s.images) for s in seqs] == [1, 1] and seqs[0].ids[0] == cfg.bos_token_id
    out = _reference_pass(tiny_vision, seqs, torch.float32)
    assert out["logits"].shape[0] == sum(len(s.ids) for s in seqs)
    assert len(out["hidden"]) == cfg.num_hidden_layers
    a = seqs[0].spans[0].start
    text = Reference(tiny_vision).forward(seqs[0].ids[:a])["logits"]
    assert torch.allclose(out["logits"][:a], text, rtol=0, atol=1e-5 * text.abs().max())
