"""Per-request sampling parameters, resolved once against the core's SamplingSpec.

Omitted fields take the prepared defaults, malformed types are rejected, and numeric
values are clamped into the declared ranges (spec: "Reasoning, sampling, and usage").
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from helios.core.sampling import DISTRIBUTION_PARAMS, Interval, SamplingSpec

SEED_MODULUS = 1 << 63  # seeds live in [0, 2**63) so every backend's generator accepts them
TOP_K_DISABLED = -1
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the sampler runs with for one choice; every field already valid and clamped."""

    temperature: float  # > 0; greedy is top_k == 1, never temperature 0
    top_p: float  # in (0, 1]; 1 keeps the whole distribution
    top_k: int  # -1 (disabled) or >= 1; 1 is exact greedy
    min_p: float  # in [0, 1]; 0 disables
    repetition_penalty: float  # > 0; 1 is neutral
    presence_penalty: float  # in [-2, 2]; 0 is neutral
    frequency_penalty: float  # in [-2, 2]; 0 is neutral
    seed: int  # in [0, 2**63), already advanced by the choice index
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id < vocab, bias in [-100, 100]) added to raw logits


class SamplingRequestError(ValueError):
    """A malformed sampling field in a request; `param` names it (HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_sampling(
    spec: SamplingSpec, requested: Mapping[str, object], *, choice_index: int = 0, vocab_size: int | None = None
) -> SamplingParams:
    """The parameters one choice samples with.

    `requested` holds the request's sampling fields (others are ignored); a missing or
    None field takes the prepared default. Types are checked for every field, even one
    that is fixed, so a malformed request fails the same way on every core.
    """
    values: dict[str, float | int] = {}
    for name in DISTRIBUTION_PARAMS:
        default = getattr(spec.defaults, name)
        raw = requested.get(name)
        if raw is None:
            values[name] = default
            continue
        value = _check_top_k(raw) if name == "top_k" else _check_float(name, raw)
        interval = spec.ranges.get(name)
        if interval is None:
            values[name] = default  # no declared range: the model author fixed it
        elif name == "top_k":
            values[name] = _clamp_top_k(int(value), interval)
        else:
            values[name] = min(max(value, interval.min), interval.max)
    seed = _resolve_seed(requested.get("seed"), spec.defaults.seed)
    bias = _logit_bias(requested.get("logit_bias"), vocab_size)
    return SamplingParams(**values, seed=(seed + choice_index) % SEED_MODULUS, logit_bias=bias)


def _logit_bias(raw: object, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as sorted (id, bias) pairs; every key and value checked."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise SamplingRequestError(
            "logit_bias", f"logit_bias must be an object of token id -> bias, got {type(raw).__name__}"
        )
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingRequestError("logit_bias", f"logit_bias has {len(raw)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    pairs = []
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingRequestError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise SamplingRequestError("logit_bias", f"logit_bias token id {token} is outside the vocabulary")
        bias = _check_float("logit_bias", value)
        if abs(bias) > LOGIT_BIAS_LIMIT:
            raise SamplingRequestError("logit_bias", f"logit_bias values must be within [-100, 100], got {value}")
        pairs.append((token, bias))
    return tuple(sorted(pairs))


def _is_number(raw: object) -> bool:
    # bool is an int subclass, but `true` is not a number in a JSON request.
    return isinstance(raw, (int, float)) and not isinstance(raw, bool)


def _check_float(name: str, raw: object) -> float:
    if not _is_number(raw):
        raise SamplingRequestError(name, f"{name} must be a number, got {type(raw).__name__}")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except OverflowError:
        value = math.inf  # an integer too large for a float: report it as non-finite
    if not math.isfinite(value):
        raise SamplingRequestError(name, f"{name} must be finite, got {raw}")
    return value


def _check_top_k(raw: object) -> int:
    # 5.0 is rejected, not truncated: the spec says top_k must be an integer.
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise SamplingRequestError("top_k", f"top_k must be an integer, got {type(raw).__name__}")
    if raw < TOP_K_DISABLED:
        raise SamplingRequestError("top_k", f"top_k must be -1 or 0 (disabled) or a positive integer, got {raw}")
    return TOP_K_DISABLED if raw == 0 else raw  # 0 is the request spelling of disabled


def _clamp_top_k(value: int, interval: Interval) -> int:
    low, high = int(interval.min), int(interval.max)
    if value == TOP_K_DISABLED:
        # Disabled keeps every token, i.e. k = +infinity; it stays disabled only when
        # the range itself allows disabling (its minimum is -1).
        return TOP_K_DISABLED if low == TOP_K_DISABLED else high
    return min(max(value, low), high)


def _resolve_seed(raw: object, default: int | None) -> int:
    if raw is None:
        # No seed anywhere: a fresh one, so unseeded requests still get independent streams.
        return default if default is not None else secrets.randbits(63)
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise SamplingRequestError("seed", f"seed must be an integer, got {type(raw).__name__}")
    return raw
