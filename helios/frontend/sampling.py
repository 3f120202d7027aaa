"""One choice's sampling parameters: the request's options range-checked and clamped into the core's
declared ranges, omitted fields at the prepared defaults (spec: "Reasoning, sampling, and usage").

Types were checked by the protocol decoder (protocols/fields.py); the engine trusts the result.
"""

from __future__ import annotations

import secrets

from helios.core.sampling import DISTRIBUTION_PARAMS, Interval, SamplingSpec
from helios.engine import SamplingParams
from helios.frontend.inference import RequestError, SamplingOptions

SEED_MODULUS = 1 << 63  # seeds live in [0, 2**63) so every backend's generator accepts them
TOP_K_DISABLED = -1
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


def resolve_sampling(
    spec: SamplingSpec, options: SamplingOptions, *, choice_index: int = 0, vocab_size: int | None = None
) -> SamplingParams:
    """The parameters choice `choice_index` samples with (its seed advanced by that index).

    A parameter without a declared range is fixed at its default, whatever the request says; an
    out-of-domain value (top_k below -1, a logit bias past 100) is refused even then.
    """
    values: dict[str, float | int] = {}
    for name in DISTRIBUTION_PARAMS:
        default = getattr(spec.defaults, name)
        value = getattr(options, name)
        if value is None:
            values[name] = default
            continue
        if name == "top_k":
            value = _top_k(value)
        interval = spec.ranges.get(name)
        if interval is None:
            values[name] = default  # no declared range: the model author fixed it
        elif name == "top_k":
            values[name] = _clamp_top_k(int(value), interval)
        else:
            values[name] = min(max(value, interval.min), interval.max)
    seed = options.seed if options.seed is not None else _fresh_seed(spec.defaults.seed)
    bias = _logit_bias(options.logit_bias, vocab_size)
    return SamplingParams(**values, seed=(seed + choice_index) % SEED_MODULUS, logit_bias=bias)


def _top_k(value: int) -> int:
    if value < TOP_K_DISABLED:
        raise RequestError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {value}", "top_k")
    return TOP_K_DISABLED if value == 0 else value  # 0 is the request spelling of disabled


def _clamp_top_k(value: int, interval: Interval) -> int:
    low, high = int(interval.min), int(interval.max)
    if value == TOP_K_DISABLED:
        # Disabled keeps every token, i.e. k = +infinity; it stays disabled only when
        # the range itself allows disabling (its minimum is -1).
        return TOP_K_DISABLED if low == TOP_K_DISABLED else high
    return min(max(value, low), high)


def _fresh_seed(default: int | None) -> int:
    # No seed anywhere: a fresh one, so unseeded requests still get independent streams.
    return default if default is not None else secrets.randbits(63)


def _logit_bias(pairs: tuple[tuple[int, float], ...], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """Sorted (id, bias) pairs, each id inside the vocabulary and each bias within [-100, 100]."""
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}", "logit_bias")
    out = []
    for token, bias in pairs:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        if abs(bias) > LOGIT_BIAS_LIMIT:
            raise RequestError(f"logit_bias values must be within [-100, 100], got {bias}", "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))
