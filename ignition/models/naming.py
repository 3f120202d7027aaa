"""Declarative weight-name maps: patterns with `{}` standing for the layer number and,
where a second `{}` follows, an expert number (the target takes them in the same order)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any


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


def with_prefixes(table: Mapping[str, str], prefixes: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """`table` plus its entries again under other prefixes: for each plain prefix -> alternatives, a
    source name starting with the plain prefix is also read with each alternative instead (where
    multimodal checkpoints keep the text model)."""
    out = dict(table)
    for source, target in table.items():
        for plain, alternatives in prefixes.items():
            if source.startswith(plain):
                out.update({alt + source[len(plain) :]: target for alt in alternatives})
    return out


def without_prefixes(name: str, prefixes: Mapping[str, tuple[str, ...]]) -> str:
    """`name` with an alternative prefix of `prefixes` (see with_prefixes) put back to its plain one."""
    for plain, alternatives in prefixes.items():
        for alt in alternatives:
            if name.startswith(alt):
                return plain + name[len(alt) :]
    return name


def nested(table: Mapping[str, Any], plain: str = "model.", under: str = "model.language_model.") -> dict[str, Any]:
    """`table` with its names under `plain` moved under `under` (where multimodal checkpoints keep the
    text model), in the same order."""
    return {(under + k[len(plain) :] if k.startswith(plain) else k): v for k, v in table.items()}


def refuse_vision_tensors(
    names: Iterable[str],
    prefixes: tuple[str, ...],
    why: str = "no vision_config, or an image token id outside the vocabulary",
) -> None:
    """A ValueError naming the first tensor under a vision tower's `prefixes`: a checkpoint whose config
    is not multimodal (`why`) must not carry one."""
    stray = sorted(n for n in names if n.startswith(prefixes))
    if stray:
        raise ValueError(
            f"unexpected tensor {stray[0]!r}: vision tensors in a checkpoint whose config is not multimodal ({why})"
        )


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
