"""The image token block ("N-layout") of dsv4-vision.md section 7 (prompt.py splices blocks).

dsv4-vision.md section 7 (reference `build_image_block`). A pad-free block for an LM grid of
gh x gw aligner tokens is
    IMAGE_START, body, [IMAGE_PAD] * tail, IMAGE_END
where the body walks the grid (rows padded to an even count with an all-IMAGE_PAD row, each row
gw IMAGE + one IMAGE_NEW_LINE) two rows at a time, column by column, and tail (0 or 2) makes
body + tail a multiple of 4. Splicing at absolute position `start` prepends lead = 3 - start % 4
IMAGE_PAD, so IMAGE_START sits at a position = 3 (mod 4), the body starts on a 4-token boundary
(no ratio-4 compressor group mixes image and preceding text) and IMAGE_END lands on = 0 (mod 4).

Only `splice` adds the lead: blocks are cached and compared pad-free, so an image reused at
another start residue can never bring a stale pad count (section 13, B1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
__all__ = ["IMAGE_START", "IMAGE_PAD", "IMAGE", "IMAGE_NEW_LINE", "IMAGE_END", "N_TYPES",
           "ImageBlock", "grid_len", "image_block", "lead_pad"]

# block types; in a prompt, type t is the out-of-vocabulary id vocab_size + t (package docstring)
IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)
N_TYPES = 5


def grid_len(gh: int, gw: int) -> int:
    """Pad-free block length of a gh x gw grid (section 6 formula)."""
    rows, rowlen = gh + gh % 2, gw + 1
    return 1 + rows * rowlen + 2 * ((rows // 2 * rowlen) % 2) + 1


def lead_pad(start: int) -> int:
    """IMAGE_PAD count before IMAGE_START for a block beginning at absolute position start."""
    return 3 - start % 4


@dataclass(frozen=True)
class ImageBlock:
    """A pad-free block: types (IMAGE_START ... IMAGE_END) and, for each IMAGE slot in block
    order, the aligner row it takes (row-major index i * gw + j of the gh x gw grid)."""

    gh: int
    gw: int
    types: tuple[int, ...]
    perm: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.types)


@lru_cache(maxsize=4096)
def image_block(gh: int, gw: int) -> ImageBlock:
    """The pad-free N-layout block of a gh x gw grid (pure; cached by grid)."""
    if gh < 1 or gw < 1:
        raise ValueError(f"empty image grid {gh}x{gw}")
    rows, rowlen = gh + gh % 2, gw + 1
    grid = [[(IMAGE, i * gw + j) for j in range(gw)] + [(IMAGE_NEW_LINE, -1)] for i in range(gh)]
    grid += [[(IMAGE_PAD, -1)] * rowlen] * (rows - gh)             # the odd grid's padding row
    body = [grid[2 * k + d][c] for k in range(rows // 2) for c in range(rowlen) for d in (0, 1)]
    tail = 2 * ((rows // 2 * rowlen) % 2)
    types = (IMAGE_START, *(t for t, _ in body), *[IMAGE_PAD] * tail, IMAGE_END)
    return ImageBlock(gh, gw, types, tuple(i for t, i in body if t == IMAGE))
