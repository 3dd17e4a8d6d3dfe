"""Built-in image prompts for checking a Vision-Exp checkpoint: deterministic synthetic images (no
files, no network) spliced between the built-in text prompts (prompts.py).

    seqs = image_prompts(ckpt / "tokenizer.json", cfg, n_images=4)      # list[VisionPrompt]
    Reference(ckpt).forward(seqs[0].ids, images=seqs[0].images)

The sizes cover the cases of dsv4-vision.md section 6: the min-pixels upscale, a letterboxed
portrait, a clamped extreme-wide image (stretched), a tall one (not clamped), a large one shrunk
to the token budget (~370 positions), and grids with odd and even row counts.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from backfit.config import ModelConfig
from backfit.verify.prompts import PROMPTS
from backfit.vision import VisionPrompt, prepare, splice

__all__ = ["IMAGE_SIZES", "image_prompts", "synthetic_png"]

# (width, height): 64x48 -> 28x28-ish upscale; 320x400 the GOLD tower size (11x9 LM grid);
# 2000x120 clamped and stretched; 60x1500 tall; 1280x720 shrunk to 14x25 = 350 IMAGE tokens
IMAGE_SIZES = ((64, 48), (320, 400), (2000, 120), (60, 1500), (1280, 720))


def synthetic_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of smooth random colour blobs plus a few sharp bars: every patch differs from its
    neighbours, as in a photo, and the bytes depend only on (width, height, seed)."""
    from PIL import Image, ImageDraw
    g = torch.Generator().manual_seed(seed)
    low = (torch.rand(max(2, height // 16), max(2, width // 16), 3, generator=g) * 255)
    img = Image.fromarray(low.to(torch.uint8).numpy()).resize((width, height),
                                                              Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = (torch.rand(2, generator=g) * torch.tensor([width, height])).long().tolist()
        colour = tuple(torch.randint(0, 256, (3,), generator=g).tolist())
        draw.rectangle([x0, y0, x0 + max(1, width // 10), y0 + max(1, height // 10)], fill=colour)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def image_prompts(tokenizer_json: Path, cfg: ModelConfig, n_images: int = len(IMAGE_SIZES),
                  prompts: list[str] | None = None) -> list[VisionPrompt]:
    """One prompt per image: BOS, a text prompt, the image, the next text prompt. Text is
    tokenized without special handling, so a quoted placeholder would stay text."""
    from tokenizers import Tokenizer
    if cfg.vision is None:
        raise ValueError("image prompts need a Vision-Exp checkpoint (vision_n_layers > 0)")
    tok, prompts = Tokenizer.from_file(str(tokenizer_json)), prompts or PROMPTS
    out = []
    for i in range(n_images):
        w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        before = tok.encode(prompts[i % len(prompts)], add_special_tokens=False).ids
        after = tok.encode(prompts[(i + 1) % len(prompts)], add_special_tokens=False).ids
        image = prepare(synthetic_png(w, h, seed=i), cfg.vision)
        out.append(splice([[cfg.bos_token_id] + before, image, after], cfg.vocab_size,
                          max_n_token=cfg.vision.max_n_token))
    return out
