"""Sampling defaults and declared ranges: the part of a recipe the sampler obeys.

A parameter with no declared interval is fixed at its default (spec: "Reasoning,
sampling, and usage"). Both ignition (recipe validation) and helios (clamping) use this.
"""

from __future__ import annotations

import math

import msgspec

# The distribution parameters a core declares, in the order tables print them.
DISTRIBUTION_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

# Values a sampler can run with; a declared interval must stay inside these.
_VALID = {
    "temperature": (0.0, math.inf),  # exclusive lower bound: temperature bounds are positive
    "top_p": (0.0, 1.0),  # exclusive lower bound
    "top_k": (-1, 1 << 31),  # -1 (or 0 in requests) disables
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, math.inf),  # exclusive lower bound
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
_EXCLUSIVE_LOW = {"temperature", "top_p", "repetition_penalty"}


class Interval(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Inclusive bounds a request value is clamped into."""

    min: float
    max: float


class SamplingDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prepared values used for omitted request fields. top_k == -1 means disabled."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: each request draws a fresh seed unless it sends one


class SamplingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Defaults plus ranges; a parameter absent from `ranges` is fixed at its default."""

    defaults: SamplingDefaults
    ranges: dict[str, Interval] = {}

    def fixed(self) -> SamplingSpec:
        """The same defaults with every parameter fixed (an export with --no-ranges)."""
        return SamplingSpec(defaults=self.defaults, ranges={})


def check_valid_value(name: str, value: float) -> str | None:
    """Why `value` is not a usable sampler value for `name`, or None."""
    low, high = _VALID[name]
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be finite, got {value}"
    if name == "top_k":
        if int(value) != value or (value < 1 and value != -1):
            return f"top_k must be -1 (disabled) or a positive integer, got {value}"
        return None
    if name in _EXCLUSIVE_LOW and value <= low:
        return f"{name} must be greater than {low:g}, got {value}"
    if value < low or value > high:
        return f"{name} must lie in [{low:g}, {high:g}], got {value}"
    return None


def validate_spec(spec: SamplingSpec) -> list[str]:
    """Every problem with a sampling spec, as messages; empty when it is usable."""
    problems: list[str] = []
    for name in DISTRIBUTION_PARAMS:
        default = getattr(spec.defaults, name)
        if (why := check_valid_value(name, default)) is not None:
            problems.append(f"default {why}")
    for name, interval in spec.ranges.items():
        if name not in DISTRIBUTION_PARAMS:
            problems.append(f"unknown range parameter {name!r} (known: {', '.join(DISTRIBUTION_PARAMS)})")
            continue
        if interval.min > interval.max:
            problems.append(f"range of {name} is empty: [{interval.min}, {interval.max}]")
        for bound in (interval.min, interval.max):
            if (why := check_valid_value(name, bound)) is not None:
                problems.append(f"range bound: {why}")
        default = getattr(spec.defaults, name)
        if not interval.min <= default <= interval.max:
            problems.append(f"default {name}={default} lies outside its range [{interval.min}, {interval.max}]")
    return problems
