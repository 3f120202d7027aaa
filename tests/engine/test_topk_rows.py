"""flare_native::topk_rows (helios/engine/native/topk.cpp), the compiled step's top-logprob op
(ignition.compiled.native_topk points a step's vocabulary-wide torch.topk at it): torch.topk's
values in descending order, and among equal values the lower index first; NaN ranks above every
number as in torch. Rows of random logits, rows full of ties, infinities and NaNs, k from 1 to the
row's width, 1-64 rows; a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from helios.engine import native

pytestmark = pytest.mark.skipif(not native.load(), reason="no C++ compiler for helios' native kernels")


def _reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending by value (NaN first), then ascending by index: a stable sort of the negated row."""
    key = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)
    nan_first = torch.isnan(x).to(torch.int64)
    order = sorted(range(x.shape[0]), key=lambda i: (-int(nan_first[i]), -float(key[i]), i))[:k]
    ids = torch.tensor(order, dtype=torch.int64)
    return x[ids], ids


def _check(x: torch.Tensor, k: int) -> None:
    values, ids = torch.ops.flare_native.topk_rows(x, k)
    assert values.shape == ids.shape == (x.shape[0], k) and ids.dtype == torch.int64
    for row in range(x.shape[0]):
        want_values, want_ids = _reference(x[row], k)
        assert torch.equal(ids[row], want_ids), row
        assert torch.equal(values[row].nan_to_num(7.0), want_values.nan_to_num(7.0)), row
    if not torch.isnan(x).any():
        torch_values = torch.topk(x, k, dim=-1).values
        assert torch.equal(values, torch_values)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_random_rows_match_torch(k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    for rows, width in ((1, 49152), (2, 1000), (7, 131), (64, 333)):
        _check(torch.randn(rows, width, generator=generator), k)


def test_ties_infinities_and_nans() -> None:
    generator = torch.Generator().manual_seed(1)
    tied = torch.randint(0, 4, (3, 300), generator=generator).float()  # hundreds of equal values
    tied[1, 5::7] = float("inf")
    tied[2, :] = float("-inf")
    tied[2, 290] = 0.0
    _check(tied, 20)
    poisoned = torch.randn(4, 257, generator=generator)
    poisoned[0, 3] = poisoned[0, 200] = float("nan")
    poisoned[1, :] = float("nan")
    poisoned[2, 256] = float("nan")
    _check(poisoned, 5)
    _check(torch.randn(2, 9, generator=generator), 9)  # k = the whole row


def test_a_row_alone_and_among_others_agree() -> None:
    x = torch.randn(64, 4099, generator=torch.Generator().manual_seed(5))
    values, ids = torch.ops.flare_native.topk_rows(x, 20)
    for row in (0, 31, 63):
        alone = torch.ops.flare_native.topk_rows(x[row : row + 1].clone(), 20)
        assert torch.equal(alone[0][0], values[row]) and torch.equal(alone[1][0], ids[row])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(RuntimeError, match="k must lie in 1..8"):
        torch.ops.flare_native.topk_rows(torch.randn(2, 8), 9)
    with pytest.raises(RuntimeError, match="float32 rows"):
        torch.ops.flare_native.topk_rows(torch.randn(2, 8, dtype=torch.bfloat16), 2)
