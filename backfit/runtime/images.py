"""Image steps on the runtime (Vision-Exp, dsv4-vision.md sections 10, 11.2 and 13 B1).

A forward's sequences may carry images: (ImageSpan, PreparedImage) pairs from backfit.vision,
each block wholly inside its sequence's chunk (the engine never splits one; check_counts
refuses a forward that does). For such a forward:

  EmbeddingCache.get   the aligner rows [gh·gw, H] of each image, by content key: the tower
                       (runtime.model.vision) runs once per image, on every TP rank (it is
                       replicated), over all of a step's missing images at once
  batch_images         -> BatchImages: the LM-input row of every image-block position (the
                       sentinel of its type, or the image's next aligner row in N-layout
                       order, ImageBlock.perm) and each token's in-span window bounds; the
                       count check runs on every sequence first (a stray id >= vocab_size
                       outside every image span is refused too)

The embedding cache holds at most IMAGE_CACHE_BYTES on the model's device, least recently used
first out; it sits outside the KV planner's budget (docs/VISION.md says how much that is).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from backfit.runtime.batch import BatchImages, to_device
from backfit.runtime.model.vision import image_embeddings, sentinel_table
from backfit.vision import IMAGE, check_counts

__all__ = ["IMAGE_CACHE_BYTES", "EmbeddingCache", "batch_images"]

IMAGE_CACHE_BYTES = 256 << 20     # ~730 real-dims images of 350 rows x 4096 in BF16


class EmbeddingCache:
    """Aligner rows by image content key on the model's device (see the module notes).
    tower_images counts the images the tower has run (tests: once per image)."""

    def __init__(self, model, max_bytes: int = IMAGE_CACHE_BYTES):
        if model.cfg.vision is None:
            raise ValueError("this checkpoint has no vision tower (config.json vision_n_layers)")
        self.model, self.max_bytes = model, max_bytes
        self._d: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = self.tower_images = 0

    def get(self, images: Sequence) -> list[torch.Tensor]:
        """PreparedImages -> their aligner rows [gh·gw, H] (row-major), in order."""
        got = {im.key: self._d[im.key] for im in images if im.key in self._d}
        for key in got:
            self._d.move_to_end(key)
        missing = list({im.key: im for im in images if im.key not in got}.values())
        if missing:
            m = self.model
            dev = m.embed.weight.device
            for im, e in zip(missing, image_embeddings(m.vision, m.aligner, missing, m.dtype,
                                                       dev)):
                got[im.key] = self._d[im.key] = e
                self.nbytes += e.numel() * e.element_size()
            self.tower_images += len(missing)
            while self.nbytes > self.max_bytes and len(self._d) > 1:
                _, old = self._d.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
        return [got[im.key] for im in images]

    def __len__(self) -> int:
        return len(self._d)


def batch_images(model, cache: EmbeddingCache, seqs: Sequence) -> BatchImages | None:
    """seqs: per sequence of the batch, in batch order, (tokens, start, images) with images the
    (ImageSpan, PreparedImage) pairs whose blocks lie in positions start .. start+len-1.
    -> BatchImages on the model's device, or None when no sequence has an image. Raises
    ImageCountError (one line) when ids and images disagree (section 13, B1)."""
    V = model.cfg.vocab_size
    for tokens, start, images in seqs:
        if not images and tokens and max(tokens) >= V:     # fast path of check_counts
            check_counts(tokens, (), (), V, offset=start)
    if not any(images for _, _, images in seqs):
        return None
    embs = iter(cache.get([im for _, _, images in seqs for _, im in images]))
    at, types, src, pos, lo_hi = [], [], [], [], []
    row = 0
    for tokens, start, images in seqs:
        e = [next(embs) for _ in images]
        check_counts(tokens, [sp for sp, _ in images], [x.shape[0] for x in e], V, offset=start)
        pos.append(torch.arange(start, start + len(tokens)))
        for (sp, im), x in zip(images, e):
            a = sp.start - start                              # the block's first row in tokens
            at.append(torch.arange(row + a, row + a + sp.length))
            types += [t - V for t in tokens[a:a + sp.length]]
            src.append(x[torch.tensor(im.block.perm, device=x.device)])   # IMAGE slots, in order
            lo_hi.append((row + sp.span_start - start, row + sp.span_end - start + 1,
                          sp.span_start, sp.span_end))
        row += len(tokens)
    dev = model.embed.weight.device
    t = torch.tensor(types)
    rows = sentinel_table(model, model.dtype)[t.to(dev)]                # [n, d]
    image_at = to_device((t == IMAGE).nonzero().flatten(), torch.int64, dev)
    rows[image_at] = torch.cat(src).to(model.dtype)      # as many: check_counts said so
    p = torch.cat(pos)
    span_lo, span_hi = p.clone(), p.clone()
    for a, b, first, last in lo_hi:                    # rows IMAGE_START .. IMAGE_END
        span_lo[a:b], span_hi[a:b] = first, last
    both = to_device(torch.stack((span_lo, span_hi)), torch.int32, dev)
    return BatchImages(rows, to_device(torch.cat(at), torch.int64, dev), both[0], both[1])
