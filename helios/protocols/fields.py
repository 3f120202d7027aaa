"""Typed field readers for decoded JSON bodies; every failure names its field (HTTP 400)."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from helios.core.sampling import DISTRIBUTION_PARAMS
from helios.frontend.inference import (
    ImagePart,
    LogprobOptions,
    RequestError,
    SamplingOptions,
    StopOptions,
    ToolChoice,
    ToolSpec,
)

_MISSING = object()
T = TypeVar("T")


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


def _optional(body: Mapping[str, Any], name: str, kind: type[T], expected: str) -> T | None:
    """The field if it is a `kind`, None if absent or null; anything else fails naming `expected`."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _type_error(name, expected, value)
    return value


def optional_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = _optional(body, name, bool, "a boolean")
    return default if value is None else value


def optional_str(body: Mapping[str, Any], name: str) -> str | None:
    return _optional(body, name, str, "a string")


def optional_object(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _optional(body, name, dict, "an object")


def model(body: Mapping[str, Any]) -> str:
    value = body.get("model")
    if not isinstance(value, str):
        raise RequestError("model is required (any string: the loaded model answers)", "model")
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


def tools(body: Mapping[str, Any]) -> list[Any]:
    """The request's `tools` array as sent (empty when absent or null); each protocol reads its entries."""
    value = body.get("tools")
    if value is not None and not isinstance(value, list):
        raise RequestError("tools must be an array", "tools")
    return value or []


def tool_choice(value: Any, specs: Sequence[ToolSpec], parallel: bool, named: Callable[[Any], str]) -> ToolChoice:
    """An OpenAI-shaped tool_choice (Chat, Responses): absent or "auto", "none", "required" (which
    needs a declared tool), else an object naming one tool; `named` reads that object's name in
    the route's spelling and raises RequestError when it does not name a declared tool."""
    if value is None or value in ("auto", "none", "required"):
        mode = value or "auto"
        if mode == "required" and not specs:
            raise RequestError("tool_choice required needs at least one declared tool", "tool_choice")
        return ToolChoice(mode, None, parallel)
    return ToolChoice("named", named(value), parallel)


def stop_options(body: Mapping[str, Any], strings: tuple[str, ...] | None = None) -> StopOptions:
    """The stops a request asks for: its `stop` strings (or `strings`, read by the protocol under
    its own name), and the native extensions every route accepts: stop_token_ids,
    stop_token_sequences and ignore_eos."""
    return StopOptions(
        strings=stop_strings(body) if strings is None else strings,
        token_ids=int_list(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") else (),
        token_sequences=token_sequences(body, "stop_token_sequences"),
        ignore_eos=optional_bool(body, "ignore_eos"),
    )


def stream_usage(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """OpenAI's stream_options: (the stream ends with a usage chunk, every chunk carries usage
    too: vLLM's continuous_usage_stats); both off without streaming."""
    options = optional_object(body, "stream_options") or {}
    include = bool(options.get("include_usage")) if stream else False
    return include, include and bool(options.get("continuous_usage_stats"))


def token_sequences(body: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _type_error(name, "an array of token-id arrays", value)
    return tuple(int_list(v, name) for v in value)


MAX_THINKING_BUDGET = (1 << 31) - 1


def thinking_token_budget(body: Mapping[str, Any]) -> int | None:
    """The native thinking_token_budget: a hard cap on reasoning tokens (OpenAI-style routes)."""
    return optional_int(body, "thinking_token_budget", 1, MAX_THINKING_BUDGET)


def top_logprobs(body: Mapping[str, Any], logprobs: bool, requires: str) -> int | None:
    """top_logprobs (0 to 20) of a route whose logprobs are on when `logprobs` (`requires` says how
    a request turns them on); None when they are off."""
    top = optional_int(body, "top_logprobs", 0, 20)
    if top and not logprobs:
        raise RequestError(f"top_logprobs requires {requires}", "top_logprobs")
    return (top or 0) if logprobs else None


def logprob_options(body: Mapping[str, Any], top: int | None, requires: str) -> LogprobOptions:
    """The generation logprobs asked for: `top` alternatives per token (None: logprobs are off, and
    `requires` says how a request turns them on), with the native logprob_token_ids and
    return_tokens_as_token_ids. Prompt logprobs are each route's own."""
    token_ids = int_list(body["logprob_token_ids"], "logprob_token_ids") if body.get("logprob_token_ids") else ()
    if token_ids and top is None:
        raise RequestError(f"logprob_token_ids requires {requires}", "logprob_token_ids")
    return LogprobOptions(top=top, token_ids=token_ids, as_token_ids=optional_bool(body, "return_tokens_as_token_ids"))


MAX_CACHE_SALT = 256


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `cache_salt`: a nonempty string (at most 256 characters) partitioning prefix reuse."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise RequestError(f"cache_salt must be a nonempty string of at most {MAX_CACHE_SALT} characters", "cache_salt")
    return value


def sampling(body: Mapping[str, Any]) -> SamplingOptions:
    """The sampling fields, their types checked (a number, an integer for top_k and seed, an object
    for logit_bias), even for a parameter the core fixes, so a malformed request fails the same way
    on every core. Ranges are the frontend's (frontend/sampling.py)."""
    values: dict[str, Any] = {
        name: _sampling_integer(name, body.get(name)) if name == "top_k" else _sampling_number(name, body.get(name))
        for name in DISTRIBUTION_PARAMS
    }
    seed = _sampling_integer("seed", body.get("seed"))
    return SamplingOptions(**values, seed=seed, logit_bias=_logit_bias(body.get("logit_bias")))


def _sampling_number(name: str, raw: Any) -> float | None:
    if raw is None:
        return None
    if not isinstance(raw, (int, float)) or isinstance(raw, bool):  # `true` is no number in JSON
        raise RequestError(f"{name} must be a number, got {type(raw).__name__}", name)
    try:
        value = float(raw)
    except OverflowError:
        value = math.inf  # an integer too large for a float: reported as non-finite
    if not math.isfinite(value):
        raise RequestError(f"{name} must be finite, got {raw}", name)
    return value


def _sampling_integer(name: str, raw: Any) -> int | None:
    # top_k 5.0 is refused, not truncated: the spec says top_k must be an integer.
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise RequestError(f"{name} must be an integer, got {type(raw).__name__}", name)
    return raw


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as (id, bias) pairs; a bias stays as sent (int or float) for messages."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise RequestError(f"logit_bias must be an object of token id -> bias, got {type(raw).__name__}", "logit_bias")
    pairs = []
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        _sampling_number("logit_bias", value)
        pairs.append((token, value))
    return tuple(pairs)


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
