"""Batch invariance on CPU: no row is ever computed alone.

torch's CPU reductions split a single output's sum over all threads (an order that depends on
the thread count) but give each of two or more outputs to one thread whole, and oneDNN runs a
one-row linear on a GEMV path whose reduction order differs from its GEMM's. A row computed
beside at least one other gets the same bits whatever its neighbours, so every single-row
computation runs with a copy of its row beside it (docs/serving.md, "Reproducibility").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

MIN_ROWS = 2  # rows a row-wise computation always sees


def padded(count: int) -> int:
    """Rows to compute for `count` wanted ones (copies of the last fill the rest)."""
    return max(count, MIN_ROWS) if count else 0


def never_alone(fn: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    """fn over rows [R, ...], with R padded to MIN_ROWS by copies of the last row, cut back to R."""
    count = rows.shape[0]
    if count == 0 or count >= MIN_ROWS:
        return fn(rows)
    extra = rows[-1:].expand(MIN_ROWS - count, *rows.shape[1:])
    return fn(torch.cat([rows, extra]))[:count]
