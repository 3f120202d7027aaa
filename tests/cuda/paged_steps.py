"""What the paged-op kernel tests share: random steps over scattered pages, a guard that fails a
kernel wrapper reading a tensor's value on the host (what would break CUDA-graph capture), and a
fix to Triton's interpreter so that bf16 tl.dot computes what a GPU computes."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from triton import language as tl
from triton.runtime import interpreter

import tests.cuda.bf16_rounding  # noqa: F401  (fp32 -> bf16 casts round to nearest even, as on a GPU)


def _bf16_dots_in_fp32() -> None:
    """Triton's interpreter (3.9) keeps bf16 blocks as their raw uint16 bits and tl.dot np.matmul's
    those bits as integers; a GPU multiplies the bf16 values exactly with fp32 accumulation. Widen
    bf16 operands to fp32 first (exact), which is that. (tests.cuda.bf16_rounding fixes the other
    bf16 difference, the rounding of fp32 -> bf16 casts.)"""
    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "widens_bf16", False):
        return

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return original(self, a, b, acc, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True  # type: ignore[attr-defined]
    interpreter.InterpreterBuilder.create_dot = create_dot


_bf16_dots_in_fp32()

# The ops that copy a tensor's value to the host or size a result by its data.
_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t)
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
}


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in _HOST_READS:
            raise AssertionError(f"host read of a tensor's value during the step: {func}")
        return func(*args, **(kwargs or {}))


def reference(op: object) -> Callable[..., object]:
    """A flare op's plain-torch body, the oracle: not the dispatcher's CPU slot, which holds helios'
    CPU kernel once another test in the process has loaded it (those need not match the reference
    on inputs serving never gives them, such as a padding row or a negative state slot)."""
    return op._init_fn  # type: ignore[attr-defined]


def _refuse(*_: object, **__: object) -> object:
    raise AssertionError("host read of a tensor's value (tolist) during the step")


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail anything inside that reads a tensor's value on the host: .item() and friends (through the
    dispatcher), data-dependent result sizes (nonzero, boolean masks), and Tensor.tolist."""
    with pytest.MonkeyPatch.context() as patch, _NoHostReads():
        patch.setattr(Tensor, "tolist", _refuse)
        yield


def captured(fn: Callable[..., object], *args: object) -> object:
    """fn(*args) under no_host_reads(): what a CUDA-graph capture of the call would allow."""
    with no_host_reads():
        return fn(*args)


class Step(NamedTuple):
    """A step's paged layout: sequences with their history lengths and query rows."""

    block_tables: Tensor  # [num_seqs, max_blocks] int32, pages scattered over the pool
    seq_lens: Tensor  # [num_seqs] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    positions: Tensor  # [num_tokens] int64
    num_pages: int


def paged_step(gen: torch.Generator, lens: list[int], queries: list[int], page_tokens: int) -> Step:
    """Sequences with `lens` history tokens (this step's included), the last `queries[i]` of them
    queried; a sequence with length 0 is a padding row (its queries, if any, see nothing). The
    pool has spare pages; page 0 is never handed out (the scratch page)."""
    blocks = [-(-n // page_tokens) for n in lens]
    num_pages = sum(blocks) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(1, *blocks), dtype=torch.int32)
    for row, count in enumerate(blocks):
        for block in range(count):
            tables[row, block] = order.pop()
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, queries)]).long()
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    return Step(tables, torch.tensor(lens, dtype=torch.int32), starts, positions, num_pages)


def sweep(*axes: Sequence[object], sample: Sequence[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """Parameter combinations: every one of the axes' product with FLARE_SLOW_TESTS set, else the
    sample (the interpreter is slow; CI runs the sample, a slow run the whole product)."""
    return list(itertools.product(*axes)) if os.environ.get("FLARE_SLOW_TESTS") else list(sample)


def assert_close(got: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    """fp32: tight; 16-bit inputs: as loose as one bf16 rounding of the result."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
