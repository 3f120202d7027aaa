"""The image caches: the engine's prepared-input cache (features by image digest, bounded, least
recently used out) and the frontend's decoded-image cache (pixels by digest, bounded, shared by
worker threads)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from helios.engine.images import ImageEncoder
from helios.engine.request import EngineImage, EngineStats
from helios.frontend.image_cache import DecodedImages


def _image(digest: bytes, rows: int, start: int = 0) -> EngineImage:
    views = lambda: [(torch.full((rows, 1), float(digest[0])), torch.zeros(rows, 2, dtype=torch.int64))]  # noqa: E731
    return EngineImage(start=start, num_tokens=rows, digest=digest, prepare=views)


def _step(encoder: ImageEncoder, image: EngineImage) -> torch.Tensor:
    seq = SimpleNamespace(request=SimpleNamespace(images=(image,)))
    return encoder.step_inputs([SimpleNamespace(seq=seq, start=image.start, num_tokens=image.num_tokens)], [0])[
        "image_features"
    ]


def test_prepared_cache_serves_a_digest_seen_before_within_its_bytes() -> None:
    calls = []

    def program(weights, kv, pixel_values, pixel_positions):
        calls.append(pixel_values.shape[0])
        return {"image_features": pixel_values.repeat(1, 4)}  # 4 fp32 columns: 16 bytes a row

    stats = EngineStats()
    encoder = ImageEncoder(program, {}, 4, 64, "cpu", stats, cache_bytes=16 * 10)
    first = _step(encoder, _image(b"a", 6))
    again = _step(encoder, _image(b"a", 6, start=30))  # another request, another position
    assert torch.equal(first, again) and calls == [6]
    assert stats.images["input_prepared_cache_hits_total"] == 1 and stats.images["input_prepared_cache_bytes"] == 96
    _step(encoder, _image(b"b", 4))  # 96 + 64 bytes: both fit
    _step(encoder, _image(b"c", 4))  # evicts the oldest ("a")
    assert stats.images["input_prepared_cache_evictions_total"] == 1
    _step(encoder, _image(b"a", 6))
    assert calls == [6, 4, 4, 6] and stats.images["input_vision_encodes_total"] == 4
    _step(encoder, _image(b"z", 11))  # larger than the whole cache: encoded, not kept
    assert stats.images["input_prepared_cache_bytes"] <= 160
    off = ImageEncoder(program, {}, 4, 64, "cpu", EngineStats(), cache_bytes=0)
    _step(off, _image(b"a", 6))
    _step(off, _image(b"a", 6))
    assert (
        off.stats.images["input_vision_encodes_total"] == 2 and off.stats.images["input_prepared_cache_hits_total"] == 0
    )


def test_decoded_images_are_kept_by_digest_within_their_bytes_from_many_threads() -> None:
    cache = DecodedImages(max_bytes=3 * 300)
    pixels = {bytes([i]): np.full((10, 10, 3), i, dtype=np.uint8) for i in range(5)}  # 300 bytes each

    def worker(keys: list[bytes]) -> None:
        for key in keys:
            if cache.get(key) is None:
                cache.put(key, pixels[key].copy())

    threads = [threading.Thread(target=worker, args=(list(pixels) * 20,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.num_bytes <= 900
    held = [key for key in pixels if cache.get(key) is not None]
    assert 1 <= len(held) <= 3 and all(int(cache.get(key)[0, 0, 0]) == key[0] for key in held)
    assert not cache.get(held[0]).flags.writeable  # shared pixels are read-only
    cache.put(b"big", np.zeros((20, 20, 3), dtype=np.uint8))  # over the whole bound: not kept
    assert cache.get(b"big") is None
