"""One image -> the ViT's input: decode, the reference resize rules, 14x14 patches.

dsv4-vision.md section 6 (reference `load_image`, as ported by PLUG / VLLM-UP / SM80F / MIA): one
native-resolution pass, no tiling. Too-wide images are clamped to `max_wh_ratio` (tall ones are
not), small ones upscaled to `min_pixels`, both sides rounded up to whole patches, then the
size shrunk until the N-layout block fits `max_n_token - 3` positions (3 = the most leading pad
a splice can add, block.py). Pixels are resized with Pillow's BICUBIC (+ antialias):
letterboxed into the target with grey 127 (`ImageOps.pad`), or stretched when the original is
at least `max_wh_ratio` times as wide as high. Ports that resample with torchvision or cv2 differ.
EXIF orientation is not applied: the reference does not either (Image.open + convert("RGB")).

The result keeps the resized uint8 pixels (3 B a pixel; 96 images of 0.6 Mpx are ~175 MB) and
makes the float patches on demand.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field

import torch

from backfit.config import VisionConfig
from backfit.vision.block import ImageBlock, grid_len, image_block

__all__ = ["ImageError", "PreparedImage", "Plan", "content_key", "decode", "prepare",
           "resize_plan", "MAX_DECODE_PIXELS"]

PAD_GREY = (127, 127, 127)            # letterbox fill; (127/255 - 0.5)/0.5 = -0.0039, not 0
MAX_DECODE_PIXELS = 64_000_000        # refuse larger originals before decoding their pixels
LEAD_MAX = 3                          # block.lead_pad(start) is 0..3


class ImageError(ValueError):
    """An image cannot be used: undecodable, empty or too large. One line, for a 4xx."""


@dataclass(frozen=True)
class Plan:
    """Target size in pixels (multiples of the patch) and the ViT / LM grids of one image."""

    width: int
    height: int
    n_vit_h: int
    n_vit_w: int
    gh: int
    gw: int


def _grid(bh: int, bw: int, p: int, r: int) -> tuple[int, int, int]:
    """(gh, gw, pad-free block length) of a bh x bw pixel target."""
    gh, gw = math.ceil((bh // p) / r), math.ceil((bw // p) / r)
    return gh, gw, grid_len(gh, gw)


def _solve(h: float, w: float, budget: int, p: int, r: int) -> tuple[int, int]:
    """The largest (bh, bw) of the image's aspect whose grid fits `budget` (reference solve)."""
    ratio = h / w
    wf = math.sqrt((budget - 2) / ratio + 0.25) - 0.5
    hf = wf * ratio
    if wf < 1.0:                                       # extremely tall: one column of tokens
        gw, gh = 1, (budget - 2) // 2
        gh -= gh % 2
        return gh * p * r, gw * p * r
    if hf < 2.0:                                       # extremely wide: two rows of tokens
        gh, gw = 2, (budget - 2) // 2 - 1
        return gh * p * r, gw * p * r
    gw, gh = math.floor(wf), math.floor(hf)
    gh -= gh % 2
    beta = min(gw * p * r / w, gh * p * r / h)
    return math.floor(h * beta / p) * p, math.floor(w * beta / p) * p


def resize_plan(width: int, height: int, vc: VisionConfig) -> Plan:
    """Section 6 size rules for an original width x height image (pure integer/float math)."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image has no pixels ({width}x{height})")
    p, r, q = vc.patch_size, vc.downsample_ratio, vc.max_wh_ratio
    w, h = width, height
    if w > q * h:                                      # only too-wide images are clamped
        w = q * h
    if 0 < w * h < vc.min_pixels:                      # upscale small images to ~min_pixels
        s = (vc.min_pixels / (w * h)) ** 0.5           # ** 0.5 as the ports (not math.sqrt)
        w, h = int(w * s), int(h * s)
    bw, bh = math.ceil(w / p) * p, math.ceil(h / p) * p
    budget = vc.max_n_token - LEAD_MAX                 # room for the leading pad of any splice
    gh, gw, n = _grid(bh, bw, p, r)
    b = budget
    while n > budget:                                  # shrink until the block fits
        bh, bw = _solve(h, w, b, p, r)
        gh, gw, n = _grid(bh, bw, p, r)
        b -= 1
    return Plan(bw, bh, bh // p, bw // p, gh, gw)


def content_key(data: bytes, vc: VisionConfig) -> str:
    """SHA-256 of the encoded image and of every constant the preprocessing reads: the same
    bytes under other limits are another entry. Never the position: blocks are pad-free."""
    consts = (vc.patch_size, vc.downsample_ratio, vc.max_n_token, vc.min_pixels, vc.max_wh_ratio)
    return hashlib.sha256(repr(consts).encode() + b"\0" + data).hexdigest()


def decode(data: bytes, max_pixels: int = MAX_DECODE_PIXELS):
    """Encoded bytes -> an RGB PIL image (first frame of an animation; alpha dropped, the stored
    RGB of transparent pixels kept). Raises ImageError naming what is wrong."""
    from PIL import Image
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:                         # before any pixel is decoded
            raise ImageError(f"image is {w}x{h} = {w * h:,} pixels, more than {max_pixels:,}")
        img.seek(0)
        return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"cannot decode image ({len(data)} bytes): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: resized pixels, grids and its pad-free N-layout block."""

    key: str                                  # content_key(): for caches and prefix caching
    pixels: torch.Tensor = field(repr=False)  # uint8 [3, height, width], resized / letterboxed
    plan: Plan
    patch_size: int

    @property
    def block(self) -> ImageBlock:
        """The pad-free block (types + perm); the leading pad is added when spliced."""
        return image_block(self.plan.gh, self.plan.gw)

    @property
    def n_patches(self) -> int:
        return self.plan.n_vit_h * self.plan.n_vit_w

    def patches(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, 3 * p * p] row-major over the ViT grid, each patch flattened channel-major
        (c, y, x); values (pixel / 255 - 0.5) / 0.5 computed in float32, then cast (the
        reference casts to BF16)."""
        p, nh, nw = self.patch_size, self.plan.n_vit_h, self.plan.n_vit_w
        x = (self.pixels.float() / 255 - 0.5) / 0.5                        # [3, nh*p, nw*p]
        x = x.reshape(3, nh, p, nw, p).permute(1, 3, 0, 2, 4)             # [nh, nw, 3, p, p]
        return x.reshape(nh * nw, 3 * p * p).to(dtype)


def _resample(img, plan: Plan, vc: VisionConfig):
    from PIL import Image, ImageOps
    size, bicubic = (plan.width, plan.height), Image.Resampling.BICUBIC
    if img.width >= vc.max_wh_ratio * img.height:      # extreme-wide original: stretch
        return img.resize(size, resample=bicubic)
    return ImageOps.pad(img, size, method=bicubic, color=PAD_GREY, centering=(0.5, 0.5))


def prepare(image, vc: VisionConfig, cache: dict | None = None) -> PreparedImage:
    """Encoded bytes (or a PIL image) -> PreparedImage. `cache` (a dict or a
    vision.cache.ImageCache) is looked up and filled by content key; what it holds does not
    depend on where the image will sit in a prompt (dsv4-vision.md section 13, B1)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        key = content_key(data, vc)
    else:                                              # a PIL image: key on its pixels
        data = None
        key = content_key(image.mode.encode() + repr(image.size).encode() + image.tobytes(), vc)
    if cache is not None and (hit := cache.get(key)) is not None:
        return hit
    img = decode(data) if data is not None else image.convert("RGB")
    plan = resize_plan(img.width, img.height, vc)
    px = torch.frombuffer(bytearray(_resample(img, plan, vc).tobytes()), dtype=torch.uint8)
    pixels = px.reshape(plan.height, plan.width, 3).permute(2, 0, 1).contiguous()
    out = PreparedImage(key, pixels, plan, vc.patch_size)
    if cache is not None:
        cache[key] = out
    return out
