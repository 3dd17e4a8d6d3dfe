"""A bounded LRU of PreparedImages by content key (preprocess.content_key).

What it holds is position-free: resized pixels, grids and the pad-free block. The leading pad
depends on where an image lands in a prompt and is added by prompt.splice every time, so a hit
at another start residue is always right (dsv4-vision.md section 13, B1: vLLM cached blocks with
their pad, keyed by bytes only, and a shifted image brought 124 embeddings to 125 slots).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from backfit.vision.preprocess import PreparedImage

__all__ = ["ImageCache"]


class ImageCache:
    """LRU bounded by pixel bytes with the dict calls preprocess.prepare uses (`get`,
    `c[key] = img`); thread-safe (the server may prepare images on several threads)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._d: OrderedDict[str, PreparedImage] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> PreparedImage | None:
        with self._lock:
            img = self._d.get(key)
            if img is None:
                self.misses += 1
                return None
            self.hits += 1
            self._d.move_to_end(key)
            return img

    def __setitem__(self, key: str, img: PreparedImage) -> None:
        size = img.pixels.numel()
        with self._lock:
            if key in self._d:
                self.nbytes -= self._d.pop(key).pixels.numel()
            self._d[key] = img
            self.nbytes += size
            while self.nbytes > self.max_bytes and len(self._d) > 1:
                _, old = self._d.popitem(last=False)
                self.nbytes -= old.pixels.numel()

    def __len__(self) -> int:
        return len(self._d)
