"""Declarative weight-name maps: patterns with `{}` standing for the layer number and,
where a second `{}` follows, an expert number (the target takes them in the same order)."""

from __future__ import annotations

import re
from collections.abc import Mapping
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
