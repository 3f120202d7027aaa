"""Declarative weight-name maps: patterns with `{}` standing for the layer number and,
where a second `{}` follows, an expert number (the target takes them in the same order)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import cache


@cache
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def rename(name: str, table: Mapping[str, str]) -> tuple[str, int | None] | None:
    """Map `name` through `table`; returns (new name, layer number or None), or None if unmapped."""
    for source, target in table.items():
        match = _compile(source).match(name)
        if match:
            numbers = [int(group) for group in match.groups()]
            return target.format(*numbers), (numbers[0] if numbers else None)
    return None


def with_biases(source: str, target: str, pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A map of weight-and-bias pairs: for each (hf, ours), `source + hf + ".weight"` -> `target + ours`
    and `source + hf + ".bias"` -> `target + ours + ".bias"`, in that order (e.g. a vision tower's layers)."""
    return {
        source + f"{hf}.{kind}": target + ours + ("" if kind == "weight" else ".bias")
        for hf, ours in pairs
        for kind in ("weight", "bias")
    }


def biased_shapes(prefix: str, names: Iterable[str], rows: int, cols: int | None = None) -> dict[str, tuple[int, ...]]:
    """Test-checkpoint shapes of weight-and-bias pairs: `prefix + name + ".weight"` [rows, cols] (a linear) or
    [rows] (a norm, cols None), then its ".bias" [rows], name by name."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        shapes[prefix + name + ".weight"] = (rows,) if cols is None else (rows, cols)
        shapes[prefix + name + ".bias"] = (rows,)
    return shapes
