"""Declarative weight-name maps: patterns with `{}` standing for the layer number."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache


@lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def rename(name: str, table: Mapping[str, str]) -> tuple[str, int | None] | None:
    """Map `name` through `table`; returns (new name, layer number or None), or None if unmapped."""
    for source, target in table.items():
        match = _compile(source).match(name)
        if match:
            layer = int(match.group(1)) if match.groups() else None
            return (target.format(layer) if layer is not None else target), layer
    return None
