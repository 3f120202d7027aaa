"""Image features for prefill: the vision program runs when a step's chunk first reaches an image.

Feature window: images are prepared and encoded one at a time (every view of an image: the vision
program runs once per view, features concatenated in the profile's order), as chunked prefill reaches each
span, and their rows stay in a bounded arena (window_tokens rows per live request) until the
chunk that consumes an image's last row has run; an evicted image is re-encoded on demand
(preemption, or a bigger batch than the arena). An image inside a reused prefix is never
prepared or encoded: no chunk reaches it.

Prepared-input cache: an image's features are also kept by its digest (its content and processing
settings), least recently used first out within `cache_bytes`, so the same image in another
request, another position or a prompt whose prefix was not reused is neither prepared nor encoded
again (features depend on nothing else: the vision program and its weights are the core's).
Views restored from host retention (memory/vision_inputs.py) run the vision program but were not
prepared here, so they are not counted as prepared.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.engine.memory.vision_inputs import RestoredInputs
from helios.engine.request import EngineImage, EngineStats
from helios.engine.sequence import Chunk

log = logging.getLogger("helios.engine")


@dataclass(frozen=True, slots=True)
class ImageRows:
    """One chunk's image rows of a step: which flat step rows take which feature rows."""

    features: Tensor  # [I, hidden] fp32
    rows: Tensor  # [I] int64 flat rows of the step; a lone -1 row when the step has no image rows


class ImageEncoder:
    def __init__(
        self,
        program,
        weights: dict[str, Tensor],
        width: int,
        window_tokens: int,
        device: str,
        stats: EngineStats,
        cache_bytes: int = 0,
    ) -> None:
        self.program = program
        self.weights = weights
        self.width = width  # feature columns (the language model's hidden size)
        self.capacity = max(window_tokens, 1)  # rows kept at once over every request
        self.device = device
        self.stats = stats
        self._arena: OrderedDict[tuple[int, int], Tensor] = OrderedDict()  # (id(request), image index) -> rows
        self._rows = 0
        self.cache_bytes = cache_bytes  # bound of the prepared-input cache (0: none)
        self._cache: OrderedDict[bytes, Tensor] = OrderedDict()  # image digest -> its feature rows, oldest first
        self._cached_bytes = 0

    def step_inputs(self, chunks: list[Chunk], starts: list[int]) -> dict[str, Tensor]:
        """image_features / image_rows of a step whose chunk i starts at flat row starts[i]."""
        features: list[Tensor] = []
        rows: list[int] = []
        done: list[tuple[int, int]] = []
        for chunk, flat in zip(chunks, starts):
            lo, hi = chunk.start, chunk.start + chunk.num_tokens
            for index, image in enumerate(chunk.seq.request.images):
                if max(lo, image.start) >= min(hi, image.end):
                    continue
                encoded = self._features(chunk.seq.request, index, image)
                for position, row, count in image.spans():  # runs of feature rows (tiled images: several)
                    a, b = max(lo, position), min(hi, position + count)
                    if a < b:
                        features.append(encoded[row + a - position : row + b - position])
                        rows += range(flat + a - lo, flat + b - lo)
                if hi >= image.end:  # this step consumes its last row: its storage is free after it
                    done.append((id(chunk.seq.request), index))
        for key in done:
            self._drop(key)
        if not rows:
            return {
                "image_features": torch.zeros(1, self.width, device=self.device),
                "image_rows": torch.full((1,), -1, dtype=torch.int64, device=self.device),
            }
        return {
            "image_features": torch.cat(features).to(self.device),
            "image_rows": torch.tensor(rows, dtype=torch.int64, device=self.device),
        }

    def _features(self, request, index: int, image: EngineImage) -> Tensor:
        key = (id(request), index)
        found = self._arena.get(key)
        if found is not None:
            self._arena.move_to_end(key)
            return found
        encoded = self._cache.get(image.digest)
        if encoded is not None and encoded.shape[0] == image.num_tokens:
            self._cache.move_to_end(image.digest)
            self.stats.images["input_prepared_cache_hits_total"] += 1
            encoded = encoded.to(self.device)  # the cache is host memory (api.md: no persistent device embeddings)
        else:
            encoded = self._encode(image)
            self._remember(image.digest, encoded)
        while self._arena and self._rows + image.num_tokens > self.capacity:
            _, evicted = self._arena.popitem(last=False)
            self._rows -= evicted.shape[0]
            self.stats.images["input_feature_evictions_total"] += 1
        self._arena[key] = encoded
        self._rows += encoded.shape[0]
        return encoded

    def _encode(self, image: EngineImage) -> Tensor:
        views = image.prepare()
        if not isinstance(views, RestoredInputs):  # restored from host retention: nothing was prepared
            self.stats.images["input_prepared_images_total"] += 1
        encoded = torch.cat(
            [
                self.program(
                    self.weights, [], pixel_values=pixels.to(self.device), pixel_positions=positions.to(self.device)
                )["image_features"]
                for pixels, positions in views
            ]
        )
        if encoded.shape[0] != image.num_tokens:
            raise RuntimeError(
                f"the vision program returned {encoded.shape[0]} rows for an image of {image.num_tokens} tokens"
            )
        self.stats.images["input_vision_encodes_total"] += 1
        self.stats.images["input_vision_tokens_total"] += image.num_tokens
        return encoded

    def _remember(self, digest: bytes, encoded: Tensor) -> None:
        """Keep an image's features by digest within cache_bytes, oldest out first."""
        size = encoded.numel() * encoded.element_size()
        if size > self.cache_bytes:
            return
        while self._cache and self._cached_bytes + size > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.numel() * old.element_size()
            self.stats.images["input_prepared_cache_evictions_total"] += 1
        # Kept in host memory on every device: api.md retains no persistent GPU image embeddings
        # (the arena holds a request's features only while its prefill needs them).
        self._cache[digest] = encoded.to("cpu")
        self._cached_bytes += size
        self.stats.images["input_prepared_cache_bytes"] = self._cached_bytes

    def _drop(self, key: tuple[int, int]) -> None:
        found = self._arena.pop(key, None)
        if found is not None:
            self._rows -= found.shape[0]

    @property
    def stored_rows(self) -> int:
        return self._rows
