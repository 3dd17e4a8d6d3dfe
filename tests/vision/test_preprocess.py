"""backfit.vision.preprocess against dsv4-vision.md section 6: sizes, grids, pixels, patches, and
undecodable input as one-line errors."""

import io

import pytest
import torch
from PIL import Image

from backfit.config import VisionConfig
from backfit.synthetic_vision import REAL_VISION
from backfit.verify.image_prompts import synthetic_png
from backfit.vision import ImageCache, ImageError, prepare, resize_plan
from backfit.vision.block import grid_len

VC = VisionConfig(**{k.removeprefix("vision_"): v for k, v in REAL_VISION.items()})

# section 6 "Worked sizes": input W x H -> resized W x H, ViT grid h x w, LM grid gh x gw,
# pad-free block length
TABLE = [
    ((64, 64), (392, 392), (28, 28), (10, 10), 114),
    ((224, 224), (392, 392), (28, 28), (10, 10), 114),
    ((384, 384), (392, 392), (28, 28), (10, 10), 114),
    ((320, 400), (350, 434), (31, 25), (11, 9), 122),
    ((512, 512), (518, 518), (37, 37), (13, 13), 198),
    ((640, 480), (644, 490), (35, 46), (12, 16), 206),
    ((560, 266), (560, 266), (19, 40), (7, 14), 122),
    ((800, 600), (812, 602), (43, 58), (15, 20), 338),
    ((756, 756), (756, 756), (54, 54), (18, 18), 346),
    ((1024, 1024), (756, 756), (54, 54), (18, 18), 346),
    ((4096, 4096), (756, 756), (54, 54), (18, 18), 346),
    ((1280, 720), (1036, 588), (42, 74), (14, 25), 366),
    ((1920, 1080), (1036, 588), (42, 74), (14, 25), 366),
    ((3000, 2000), (882, 588), (42, 63), (14, 21), 310),
    ((2000, 120), (1092, 140), (10, 78), (4, 26), 110),
    ((60, 1500), (84, 1932), (138, 6), (46, 2), 142),
]


@pytest.mark.parametrize("size,resized,vit,lm,length", TABLE,
                         ids=[f"{s[0]}x{s[1]}" for s, *_ in TABLE])
def test_resize_table(size, resized, vit, lm, length):
    p = resize_plan(*size, VC)
    assert (p.width, p.height) == resized
    assert (p.n_vit_h, p.n_vit_w) == vit and (p.gh, p.gw) == lm
    assert grid_len(p.gh, p.gw) == length <= VC.max_n_token - 3


def test_every_size_fits_the_budget():
    """Any aspect and size: at most max_n_token - 3 pad-free positions (384 with the pad)."""
    for w in (1, 14, 41, 97, 300, 1111, 5000, 20000):
        for h in (1, 13, 42, 99, 333, 1234, 4999, 30000):
            p = resize_plan(w, h, VC)
            assert grid_len(p.gh, p.gw) <= 381, (w, h)
            assert p.width % 14 == 0 and p.height % 14 == 0
            assert (p.gh, p.gw) == (-(-p.n_vit_h // 3), -(-p.n_vit_w // 3))


def _png(w, h, colour=(200, 30, 60), mode="RGB"):
    out = io.BytesIO()
    Image.new(mode, (w, h), colour).save(out, format="PNG")
    return out.getvalue()


def test_pixels_and_patches():
    """320x400 (the GOLD tower input): 350x434 pixels, 775 patches of 588 values, row-major over
    the 31x25 grid, each channel-major; values (x / 255 - 0.5) / 0.5."""
    img = prepare(synthetic_png(320, 400, seed=3), VC)
    assert img.pixels.shape == (3, 434, 350) and img.pixels.dtype == torch.uint8
    x = img.patches()
    assert x.shape == (775, 588) and x.dtype == torch.float32
    i, j = 17, 9                                           # patch (row 17, column 9)
    want = img.pixels[:, i * 14:(i + 1) * 14, j * 14:(j + 1) * 14].float() / 255 * 2 - 1
    assert torch.allclose(x[i * 25 + j], want.flatten(), atol=1e-6)
    assert img.patches(torch.bfloat16).dtype == torch.bfloat16


def test_letterbox_is_grey_and_wide_images_stretch():
    """60x1500 is letterboxed into 84x1932 with grey 127 columns; 2000x120 (>= 8:1) is
    stretched to 1092x140 with no border at all."""
    tall = prepare(_png(60, 1500), VC).pixels
    assert tall.shape == (3, 1932, 84)
    assert (tall[:, :, 0] == 127).all() and (tall[:, :, -1] == 127).all()
    assert (tall[:, :, 42] == torch.tensor([200, 30, 60])[:, None]).all()
    wide = prepare(_png(2000, 120), VC).pixels
    assert wide.shape == (3, 140, 1092)
    assert (wide == torch.tensor([200, 30, 60])[:, None, None]).all()


def test_alpha_and_animation():
    """RGBA: alpha dropped, the stored RGB kept; GIF: the first frame."""
    assert (prepare(_png(400, 400, (10, 20, 30, 0), "RGBA"), VC).pixels[:, 5, 5]
            == torch.tensor([10, 20, 30])).all()
    frames = [Image.new("RGB", (400, 400), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    px = prepare(out.getvalue(), VC).pixels
    assert px[0, 200, 200] > 200 and px[2, 200, 200] < 50


@pytest.mark.parametrize("data,needle", [
    (b"", "cannot decode image (0 bytes)"),
    (b"GIF89a not really", "cannot decode image"),
    (_png(50, 50)[:60], "cannot decode image"),                       # truncated PNG
])
def test_undecodable_is_one_line(data, needle):
    with pytest.raises(ImageError) as e:
        prepare(data, VC)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_too_many_pixels_refused_before_decoding():
    from backfit.vision.preprocess import decode
    with pytest.raises(ImageError, match="3000x2000 = 6,000,000 pixels, more than 1,000,000"):
        decode(_png(3000, 2000), max_pixels=1_000_000)


def test_cache_by_content():
    cache = ImageCache()
    a = prepare(synthetic_png(300, 200, 1), VC, cache)
    assert prepare(synthetic_png(300, 200, 1), VC, cache) is a and cache.hits == 1
    assert prepare(synthetic_png(300, 200, 2), VC, cache) is not a            # other content
    other = VisionConfig(**{**VC.__dict__, "max_n_token": 200})
    assert prepare(synthetic_png(300, 200, 1), other, cache).key != a.key     # other limits


def test_cache_is_bounded():
    cache = ImageCache(max_bytes=3 * 392 * 392 * 2)                # two 392x392 images
    keys = [prepare(_png(100, 100, (i, 0, 0)), VC, cache).key for i in range(3)]
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) is not None
    assert cache.nbytes <= cache.max_bytes
