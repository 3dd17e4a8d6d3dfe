"""Image steps on the runtime (Vision-Exp, dsv4-vision.md sections 10, 11.2 and 13 B1).

A forward's sequences may carry images: (ImageSpan, PreparedImage) pairs from backfit.vision,
each block wholly inside its sequence's chunk (the engine never splits one; check_counts
refuses a forward that does). For such a forward:

  EmbeddingCache.get   the aligner rows [gh·gw, H] of each image, by content key: the tower
                       (runtime.model.vision) runs once per image, over all of a step's missing
                       images at once; at tp > 1 the TP ranks share that work (see below)
  batch_images         -> BatchImages: the LM-input row of every image-block position (the
                       sentinel of its type, or the image's next aligner row in N-layout
                       order, ImageBlock.perm) and each token's in-span window bounds; the
                       count check runs on every sequence first (a stray id >= vocab_size
                       outside every image span is refused too)

The tower's weights are replicated on every rank, but its work is not: at tp > 1 each rank runs
only its share of a step's missing images (assign_ranks: balanced by patch count, the same on
every rank, since the missing list and the caches are), and one all-gather per step with new
images (distributed.all_gather_rows, rows padded to the largest share) gives every rank every
image's rows, the computing rank's bits, so the ranks' caches stay identical. At tp 1 the
tower runs on all of them in this process, as before. The reason: run on every rank, the work
would be done tp times over (96 images of 1024x768: ~1.95 s of a 4.1 s TTFT, one TP-4 rank's
43-layer slice on an H100).

The embedding cache holds at most IMAGE_CACHE_BYTES on the model's device, least recently used
first out; it sits outside the KV planner's budget (docs/VISION.md says how much that is).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from backfit.runtime.batch import BatchImages, to_device
from backfit.runtime.distributed import all_gather_rows, get_tp_info
from backfit.runtime.model.vision import image_embeddings, sentinel_table
from backfit.vision import IMAGE, check_counts

__all__ = ["IMAGE_CACHE_BYTES", "EmbeddingCache", "assign_ranks", "batch_images"]

IMAGE_CACHE_BYTES = 256 << 20     # ~730 real-dims images of 350 rows x 4096 in BF16


def assign_ranks(n_patches: Sequence[int], size: int) -> list[int]:
    """The rank that runs each image through the tower (one entry per image, in order): greedy,
    the largest image first (earlier first among equals) to the least-loaded rank by patches
    (the lowest rank among equals). Deterministic; a rank may get none."""
    load, owner = [0] * size, [0] * len(n_patches)
    for i in sorted(range(len(n_patches)), key=lambda i: (-n_patches[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += n_patches[i]
    return owner


class EmbeddingCache:
    """Aligner rows by image content key on the model's device (see the module notes).
    tower_images counts the images whose rows entered the cache (tests: once per image, on
    every rank); tower_ran the images this rank ran through the tower itself (at tp > 1 its
    share only)."""

    def __init__(self, model, max_bytes: int = IMAGE_CACHE_BYTES):
        if model.cfg.vision is None:
            raise ValueError("this checkpoint has no vision tower (config.json vision_n_layers)")
        self.model, self.max_bytes = model, max_bytes
        self._d: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = self.tower_images = self.tower_ran = 0

    def get(self, images: Sequence) -> list[torch.Tensor]:
        """PreparedImages -> their aligner rows [gh·gw, H] (row-major), in order."""
        got = {im.key: self._d[im.key] for im in images if im.key in self._d}
        for key in got:
            self._d.move_to_end(key)
        missing = list({im.key: im for im in images if im.key not in got}.values())
        if missing:
            for im, e in zip(missing, self._tower(missing)):
                got[im.key] = self._d[im.key] = e
                self.nbytes += e.numel() * e.element_size()
            self.tower_images += len(missing)
            while self.nbytes > self.max_bytes and len(self._d) > 1:
                _, old = self._d.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
        return [got[im.key] for im in images]

    def _tower(self, missing: list) -> list[torch.Tensor]:
        """The rows [gh·gw, H] of each missing image (the same list on every rank), in order."""
        m, tp = self.model, get_tp_info()
        dev = m.embed.weight.device
        if tp.size == 1:
            self.tower_ran += len(missing)
            return image_embeddings(m.vision, m.aligner, missing, m.dtype, dev)
        owner = assign_ranks([im.n_patches for im in missing], tp.size)
        mine = [im for im, r in zip(missing, owner) if r == tp.rank]
        self.tower_ran += len(mine)
        rows = [im.plan.gh * im.plan.gw for im in missing]      # aligner rows per image
        local = image_embeddings(m.vision, m.aligner, mine, m.dtype, dev)    # [gh·gw, H] each
        x = torch.cat(local) if local else torch.empty(0, m.cfg.hidden_size, dtype=m.dtype,
                                                       device=dev)          # [R_rank, H]
        per_rank = [[n for n, o in zip(rows, owner) if o == r] for r in range(tp.size)]
        parts = [iter(p.split(n))                                           # [R_r, H] each
                 for p, n in zip(all_gather_rows(x, [sum(n) for n in per_rank]), per_rank)]
        # a copy each: a view would keep its rank's whole gathered buffer alive in the cache
        return [next(parts[r]).clone() for r in owner]

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
