"""A second fix to Triton's interpreter (beside paged_steps' bf16 dots) so that kernels which round
to bf16 compute there what a GPU computes: the interpreter (3.9) narrows fp32 to bf16 by cutting
the low 16 bits (round toward zero), while a GPU's `.to(tl.bfloat16)` rounds to nearest even, as
torch's `.to(torch.bfloat16)` in the references does. Importing this module installs the fix."""

from __future__ import annotations

import numpy as np
import torch
from triton import language as tl
from triton.runtime import interpreter


def _bf16_rounds_to_nearest() -> None:
    original = interpreter.InterpreterBuilder.cast_impl
    if getattr(original, "rounds_bf16", False):
        return

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl.rounds_bf16 = True  # type: ignore[attr-defined]
    interpreter.InterpreterBuilder.cast_impl = cast_impl


_bf16_rounds_to_nearest()
