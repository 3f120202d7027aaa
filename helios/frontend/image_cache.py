"""The frontend's image caches: an image sent again (every turn of a conversation carries its
earlier images; System One decodes a state image once per question) is not decoded again.

DecodedImages: decoded pixels in this process, keyed by the image's digest (its bytes and the
core's processing settings, the same digest that identifies its prefix pages), bounded in bytes,
least recently used first out. The frontend's worker threads share it, so every access holds its
lock. Decoded pixels are read-only: the engine's preparation copies them before resizing.

retained_inputs: the host retention of prepared views (the engine's VisionInputStore, in the
configured host cache's DRAM and disk tiers), which also spares preprocessing and survives
restarts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from helios.config import ServerConfig
from helios.core.manifest import VisionProfile
from helios.engine import (
    HostCacheConfig,
    VisionInputStore,
    default_host_cache_directory,
    default_host_cache_memory_bytes,
    vision_identity,
)
from helios.frontend import images as imaging


def host_cache_config(config: ServerConfig) -> HostCacheConfig | None:
    """The host prefix store's tiers from the [server] settings, or None with host_cache off (the
    engine's prefix store and the frontend's retention of prepared images both read these)."""
    if not config.host_cache:
        return None
    memory = (
        config.host_cache_memory_mb << 20
        if config.host_cache_memory_mb is not None
        else default_host_cache_memory_bytes()
    )
    directory = Path(config.host_cache_dir).expanduser() if config.host_cache_dir else default_host_cache_directory()
    return HostCacheConfig(
        memory,
        directory if config.host_cache_disk_mb else None,
        config.host_cache_disk_mb << 20,
        config.host_cache_copy_queue_mb << 20,
    )


def retained_inputs(profile: VisionProfile, config: ServerConfig) -> VisionInputStore | None:
    """Host retention of this profile's prepared images, or None with host_cache off. Its DRAM tier
    is bounded like the other image caches (image_cache_mb, and the host memory budget); its disk
    tier is one more record directory under host_cache_dir, bounded by host_cache_disk_mb."""
    tiers = host_cache_config(config)
    if tiers is None:
        return None
    return VisionInputStore(
        vision_identity(imaging.preparation(profile)),
        min(tiers.memory_bytes, config.image_cache_mb << 20),
        tiers.directory,
        tiers.disk_bytes,
    )


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
