"""Splicing image blocks into a prompt (the lead pad added here, never cached) and the count
check of image slots against embedding rows (dsv4-vision.md sections 7 and 13, B1)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from backfit.vision.block import IMAGE, IMAGE_END, IMAGE_PAD, IMAGE_START, N_TYPES, lead_pad
from backfit.vision.preprocess import PreparedImage

__all__ = ["ImageCountError", "ImageSpan", "VisionPrompt", "check_counts", "splice"]


@dataclass(frozen=True)
class ImageSpan:
    """Where image `index` of a prompt sits: positions start .. start + length - 1, the first
    `lead` of them IMAGE_PAD (outside the bidirectional span), then IMAGE_START .. IMAGE_END."""

    index: int
    start: int
    lead: int
    length: int
    n_image: int            # IMAGE slots = rows of this image's embeddings (gh * gw)
    key: str                # the image's content key (prefix caching must include it)

    @property
    def span_start(self) -> int:
        """Position of IMAGE_START: the first position of the in-image attention span."""
        return self.start + self.lead

    @property
    def span_end(self) -> int:
        """Position of IMAGE_END (inclusive)."""
        return self.start + self.length - 1


@dataclass(frozen=True)
class VisionPrompt:
    """A spliced prompt: ids (text ids, and vocab_size + type on image-block positions), one
    span per image in order, the prepared images (same order)."""

    ids: tuple[int, ...]
    spans: tuple[ImageSpan, ...]
    images: tuple[PreparedImage, ...]
    vocab_size: int

    def is_image(self) -> list[bool]:
        """Per position: inside an image block (all five types, leading pads included)."""
        return [t >= self.vocab_size for t in self.ids]


class ImageCountError(ValueError):
    """Image slots and embedding rows disagree (section 13, B1): never run such a forward."""


def splice(segments: Sequence, vocab_size: int, start: int = 0,
           max_n_token: int | None = None) -> VisionPrompt:
    """Text id lists and PreparedImages, in prompt order -> VisionPrompt.

    Images are placed structurally, never found by searching ids for a placeholder, so text can
    not become an image (section 13, B2-B4). Text ids must lie in [0, vocab_size): the block ids
    vocab_size + type are written here only. start: absolute position of the first segment (a
    continuation of an earlier prefix). max_n_token: refuse a block longer than this.
    """
    ids: list[int] = []
    spans, images = [], []
    for s, seg in enumerate(segments):
        if hasattr(seg, "block"):                                  # a PreparedImage
            pos = start + len(ids)
            block, lead = seg.block, lead_pad(pos)
            if max_n_token is not None and lead + len(block) > max_n_token:
                raise ValueError(f"image {len(spans)}: block of {lead + len(block)} positions "
                                 f"exceeds vision_max_n_token {max_n_token}")
            spans.append(ImageSpan(len(spans), pos, lead, lead + len(block), len(block.perm),
                                   seg.key))
            images.append(seg)
            ids += [vocab_size + IMAGE_PAD] * lead + [vocab_size + t for t in block.types]
            continue
        for j, t in enumerate(seg):
            try:
                t = operator.index(t)
            except TypeError:
                t = None
            if t is None or not 0 <= t < vocab_size:
                raise ValueError(f"segment {s}, token {j}: {seg[j]!r} is not a text id in "
                                 f"[0, {vocab_size}) (image ids come from images only)")
            ids.append(t)
    return VisionPrompt(tuple(ids), tuple(spans), tuple(images), vocab_size)


def check_counts(ids: Sequence[int], spans: Sequence[ImageSpan], rows: Sequence[int],
                 vocab_size: int, offset: int = 0) -> None:
    """Raise ImageCountError unless every span holds exactly one IMAGE_START ... IMAGE_END block
    with as many IMAGE slots as its image has embedding rows, and no image id lies outside the
    spans. ids: the positions offset .. offset + len(ids) - 1 (a forward's window of a prompt);
    spans / rows: the images inside that window and their embedding row counts."""
    if len(spans) != len(rows):
        raise ImageCountError(f"{len(spans)} image spans but {len(rows)} embedding tensors")
    covered = 0
    for span, n_rows in zip(spans, rows):
        a, b = span.start - offset, span.start - offset + span.length
        if a < 0 or b > len(ids):
            raise ImageCountError(f"image {span.index} (positions {span.start}-{span.span_end}) "
                                  f"is not whole inside positions {offset}-{offset + len(ids) - 1}")
        types = [t - vocab_size for t in ids[a:b]]
        n_slots = types.count(IMAGE)
        ok = (types[:span.lead] == [IMAGE_PAD] * span.lead and types[span.lead] == IMAGE_START
              and types[-1] == IMAGE_END and types.count(IMAGE_START) == types.count(IMAGE_END) == 1
              and min(types) >= 0 and max(types) < N_TYPES)
        if not ok:
            raise ImageCountError(f"image {span.index} (positions {span.start}-{span.span_end}): "
                                  f"not an image block at those positions")
        if n_slots != n_rows or n_slots != span.n_image:
            raise ImageCountError(f"image {span.index} (positions {span.start}-{span.span_end}): "
                                  f"{n_rows} embedding rows for {n_slots} IMAGE slots "
                                  f"({span.n_image} expected)")
        covered += span.length
    outside = sum(t >= vocab_size for t in ids) - covered
    if outside:
        raise ImageCountError(f"{outside} image-block ids outside every image span")
