"""Typed field readers for decoded JSON bodies; every failure names its field (HTTP 400)."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

from helios.frontend.inference import ImagePart, RequestError

_MISSING = object()


def _type_error(name: str, expected: str, value: Any) -> RequestError:
    return RequestError(f"{name} must be {expected}, got {type(value).__name__} {value!r}"[:300], name)


def optional_int(body: Mapping[str, Any], name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(name, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise RequestError(f"{name} must be in {bounds}, got {value}", name)
    return value


def optional_number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _type_error(name, "a finite number", value)
    return float(value)


def optional_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def optional_object(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    return value


def int_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
        raise _type_error(name, "an array of integers", value)
    return tuple(value)


def stop_strings(body: Mapping[str, Any], name: str = "stop") -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _type_error(name, "a string or an array of strings", value)


def token_sequences(body: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _type_error(name, "an array of token-id arrays", value)
    return tuple(int_list(v, name) for v in value)


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
)


MAX_CACHE_SALT = 256


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `cache_salt`: a nonempty string (at most 256 characters) partitioning prefix reuse."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise RequestError(f"cache_salt must be a nonempty string of at most {MAX_CACHE_SALT} characters", "cache_salt")
    return value


def sampling(body: Mapping[str, Any]) -> dict[str, object]:
    """The raw sampling values; types are checked by the shared resolver (one place)."""
    return {name: body.get(name) for name in SAMPLING_FIELDS}


def reject(body: Mapping[str, Any], names: tuple[str, ...], why: str = "is not supported") -> None:
    for name in names:
        if body.get(name) is not None:
            raise RequestError(f"{name} {why}", name)


IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")


def data_url_image(url: Any, param: str, missing: str) -> ImagePart:
    """A base64 `data:` URL as an image part; `missing` explains what to send instead."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError(missing, param)
    header, _, data = url.partition(",")
    media_type = header[5:].split(";")[0]
    if media_type not in IMAGE_TYPES:
        raise RequestError(f"unsupported image type {media_type!r} (PNG, JPEG or static WebP)", param)
    try:
        return ImagePart(base64.b64decode(data, validate=True), media_type)
    except (binascii.Error, ValueError):
        raise RequestError("an image data URL is not valid base64", param) from None
