"""The frontend's decoded-image cache: an image sent again (every turn of a conversation carries
its earlier images; System One decodes a state image once per question) is not decoded again.

Keyed by the image's digest (its bytes and the core's processing settings, the same digest that
identifies its prefix pages), bounded in bytes, least recently used first out. The frontend's
worker threads share it, so every access holds its lock. Decoded pixels are read-only: the
engine's preparation copies them before resizing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class DecodedImages:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._images: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> np.ndarray | None:
        with self._lock:
            found = self._images.get(digest)
            if found is not None:
                self._images.move_to_end(digest)
            return found

    def put(self, digest: bytes, rgb: np.ndarray) -> None:
        size = rgb.nbytes
        if size > self.max_bytes:
            return
        rgb.setflags(write=False)
        with self._lock:
            if digest in self._images:
                return
            while self._images and self._bytes + size > self.max_bytes:
                _, old = self._images.popitem(last=False)
                self._bytes -= old.nbytes
            self._images[digest] = rgb
            self._bytes += size

    @property
    def num_bytes(self) -> int:
        return self._bytes
