"""Triton's interpreter (3.9) fixed to compute what a GPU computes, for the tests/cuda kernel tests:
paged_steps' bf16 dots, bf16_rounding's round-to-nearest fp32 -> bf16, and comparisons typed bool.
Importing this module installs all three (each idempotent).

The interpreter tags a comparison's result with its operands' type (int32 for `s != 0`) although
its values are bool, so a scalar comparison splatted into a block mask (`mask & carried`) turns
the mask into int32 and tl.load rejects it; on a GPU the result is i1.
"""

from __future__ import annotations

import numpy as np
from triton import language as tl
from triton.runtime import interpreter

import tests.cuda.bf16_rounding  # noqa: F401
import tests.cuda.paged_steps  # noqa: F401


def _comparisons_are_bool() -> None:
    original = interpreter.InterpreterBuilder.binary_op
    if getattr(original, "types_bool", False):
        return

    def binary_op(self, lhs, rhs, op):  # noqa: ANN001, ANN202
        out = original(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            return interpreter.TensorHandle(out.data, tl.int1)
        return out

    binary_op.types_bool = True  # type: ignore[attr-defined]
    interpreter.InterpreterBuilder.binary_op = binary_op


_comparisons_are_bool()
