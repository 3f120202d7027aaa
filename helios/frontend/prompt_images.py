"""The images of a conversation prompt: costed from their headers against the prompt's limits,
expanded from the template's placeholders into the profile's token layout, and decoded once
(a content-addressed cache) into the engine's lazily prepared images. Prepared views are also
kept in host retention (image_cache.retained_inputs): an image found there is neither decoded
nor preprocessed, and one whose record went (evicted, corrupt) is rebuilt from its data.
"""

from __future__ import annotations

import functools

import numpy as np

from helios.config import ServerConfig
from helios.core.manifest import VisionProfile
from helios.engine import IMAGE_COUNTERS, EngineImage
from helios.frontend import images as imaging
from helios.frontend.image_cache import DecodedImages, retained_inputs
from helios.frontend.inference import ImagePart, Message, RequestError, ToolResultPart
from helios.frontend.limits import RequestLimits

TEXT_ONLY_IMAGES = "this model does not accept images (its core has no vision program)"


class ImageRejected(RequestError):
    """A 400 about the request's images (limits, budget, format), not its text or template."""


def message_images(messages: list[Message]) -> list[ImagePart]:
    """The images of lowered messages in the order the template renders them (tool results' inline)."""
    out: list[ImagePart] = []
    for message in messages:
        for part in message.parts:
            if isinstance(part, ImagePart):
                out.append(part)
            elif isinstance(part, ToolResultPart):
                out += [p for p in part.content if isinstance(p, ImagePart)]
    return out


Costed = tuple[ImagePart, imaging.ImageHeader, imaging.ImageCost]


def image_counters() -> dict[str, int]:
    """The frontend's share of the image metrics (under their names without flare_), all zero."""
    counters = dict.fromkeys(IMAGE_COUNTERS[:3], 0)  # decoded, rejected, decoded bytes
    counters["input_decode_cache_hits_total"] = 0  # images not decoded again (image_cache.py)
    counters["input_host_cache_hits_total"] = 0  # images not decoded: host retention held their prepared views
    counters["input_host_cache_restores_total"] = 0  # prepared views restored from host retention (not preprocessed)
    return counters


class PromptImages:
    """A vision core's images: limits, layout, decoding; counted into the frontend's counters."""

    def __init__(
        self, profile: VisionProfile, limits: RequestLimits, config: ServerConfig, counters: dict[str, int]
    ) -> None:
        self.profile = profile
        self.max_images = limits.max_images_per_prompt
        self.max_image_tokens = limits.max_image_tokens_per_prompt
        self.decoded = DecodedImages(config.image_cache_mb << 20)
        self.retained = retained_inputs(profile, config)  # None: host_cache off
        self.counters = counters

    def check(self, parts: list[ImagePart]) -> list[Costed]:
        """Cost every image from its header (no decode), then refuse: single images against their
        limits with the observed size, then the whole request against the prompt budget, naming
        the first image past it. Returns (part, header, cost) per image, in prompt order."""
        profile = self.profile
        if len(parts) > self.max_images:
            self.counters["input_rejected_images_total"] += len(parts)
            raise ImageRejected(
                f"the request has {len(parts)} images, over max_images_per_prompt {self.max_images}",
                "messages",
            )
        costed = []
        for number, part in enumerate(parts, 1):
            where = f"image {number}"
            try:
                header = imaging.read_header(part.data, profile, where)
                cost = imaging.cost(header.width, header.height, profile)
            except imaging.ImageError as exc:
                self.counters["input_rejected_images_total"] += 1
                raise ImageRejected(str(exc), "messages") from None
            if cost.num_tokens > profile.max_image_tokens_per_image:
                self.counters["input_rejected_images_total"] += 1
                raise ImageRejected(
                    f"{where} ({header.width}x{header.height} pixels) costs {cost.num_tokens} image "
                    f"tokens, over max_image_tokens_per_image {profile.max_image_tokens_per_image}",
                    "messages",
                )
            if cost.num_tokens < 2:
                self.counters["input_rejected_images_total"] += 1
                raise ImageRejected(
                    f"{where} ({header.width}x{header.height} pixels) resizes to {cost.num_tokens} image "
                    "token; this core's vision program needs at least 2",
                    "messages",
                )
            costed.append((part, header, cost))
        total = sum(c.num_tokens for _, _, c in costed)
        budget = self.max_image_tokens
        if total > budget:
            running, first = 0, 0
            for first, (_, _, c) in enumerate(costed, 1):  # noqa: B007 - read after the loop
                running += c.num_tokens
                if running > budget:
                    break
            _, header, c = costed[first - 1]
            patches = sum(c.num_patches for _, _, c in costed)
            self.counters["input_rejected_images_total"] += len(costed)
            raise ImageRejected(
                f"the request's {len(costed)} images cost {total} image tokens ({patches} patches), over "
                f"max_image_tokens_per_prompt {budget}; image {first} ({header.width}x{header.height} "
                f"pixels, {c.num_tokens} tokens) is the first past it",
                "messages",
            )
        return costed

    def expand(
        self, ids: list[int], costs: list[imaging.ImageCost]
    ) -> tuple[list[int], list[tuple[int, int, int, tuple[tuple[int, int], ...]]]]:
        """Each template-rendered placeholder -> the profile's token layout (framing and one image
        token per feature row, imaging.token_layout). Returns the ids and, per image, (placeholder
        position before, first image-token position after, tokens added, EngineImage.runs)."""
        profile = self.profile
        found = [i for i, t in enumerate(ids) if t == profile.placeholder_token_id]
        if len(found) != len(costs):
            raise RequestError(
                f"the chat template rendered {len(found)} image placeholders for {len(costs)} images", "messages"
            )
        out: list[int] = []
        spans: list[tuple[int, int, int, tuple[tuple[int, int], ...]]] = []
        previous = 0
        for position, cost in zip(found, costs):
            out += ids[previous:position]
            layout, runs = imaging.token_layout(cost, profile)
            first = runs[0][0]
            relative = tuple((offset - first, rows) for offset, rows in runs) if len(runs) > 1 else ()
            spans.append((position, len(out) + first, len(layout) - 1, relative))
            out += layout
            previous = position + 1
        return out + ids[previous:], spans

    @staticmethod
    def shifted(position: int, growth: list[tuple[int, int]]) -> int:
        """A pre-expansion token position after image expansion: it moves by the growth of every
        placeholder before it."""
        return position + sum(grown for placeholder, grown in growth if placeholder < position)

    def engine_image(
        self,
        part: ImagePart,
        header: imaging.ImageHeader,
        cost: imaging.ImageCost,
        start: int,
        runs: tuple[tuple[int, int], ...] = (),
    ) -> EngineImage:
        """Decode now (the frontend pool) unless host retention holds the image's prepared views;
        prepare later, only if prefill reaches the image (the engine: _inputs)."""
        digest = imaging.content_digest(part.data, self.profile)
        rgb = self.decoded.get(digest)
        if rgb is not None:
            self.counters["input_decode_cache_hits_total"] += 1
        elif self.retained is not None and self.retained.holds(digest, imaging.source_description(header)):
            self.counters["input_host_cache_hits_total"] += 1
        else:
            rgb = self._decode(part, header, digest)
        return EngineImage(
            start=start,
            num_tokens=cost.num_tokens,
            digest=digest,
            prepare=functools.partial(self._inputs, part, header, digest, rgb),
            pixels=header.width * header.height,
            runs=runs,
        )

    def _decode(self, part: ImagePart, header: imaging.ImageHeader, digest: bytes) -> np.ndarray:
        try:
            rgb = imaging.decode(part.data)
        except Exception:
            self.counters["input_rejected_images_total"] += 1
            raise ImageRejected(
                f"an image ({header.width}x{header.height} {header.format}) could not be decoded", "messages"
            ) from None
        self.counters["input_decoded_images_total"] += 1
        self.counters["input_decoded_image_bytes_total"] += header.num_bytes
        self.decoded.put(digest, rgb)
        return rgb

    def _inputs(
        self, part: ImagePart, header: imaging.ImageHeader, digest: bytes, rgb: np.ndarray | None
    ) -> list[tuple]:
        """EngineImage.prepare (the engine thread, when prefill reaches the image): the views host
        retention holds, else prepared from the pixels (decoded now when the record the lookup
        found has gone since) and retained."""
        source = imaging.source_description(header)
        if self.retained is not None:
            restored = self.retained.restore(digest, source)
            if restored is not None:
                self.counters["input_host_cache_restores_total"] += 1
                return restored
        if rgb is None:
            rgb = self._decode(part, header, digest)
        views = imaging.prepare_views(rgb, self.profile)
        if self.retained is not None:
            self.retained.retain(digest, source, views)
        return views
