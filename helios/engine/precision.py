"""Whether this host multiplies bfloat16 natively, measured rather than read from a flag list.

A bf16 core halves the bytes every decode step streams; on a CPU with AVX-512 BF16 or AMX
its matmuls are also faster. Without such units bf16 matmuls are emulated and run several
times slower than fp32 (seen: 19 vs 106 GFLOP/s), so there the weights are better upcast
once at load.
"""

from __future__ import annotations

import time

import torch

from helios.engine import prepack

_ROWS, _IN, _OUT = 8, 1024, 2048
NATIVE_SPEEDUP = 1.1  # bf16 must beat fp32 by this factor to count as native


def _seconds(dtype: torch.dtype) -> float:
    """20 linears as the engine runs them (oneDNN-packed where available)."""
    x = torch.randn(_ROWS, _IN).to(dtype)
    w = torch.randn(_OUT, _IN).to(dtype)
    if prepack.available():
        packed = prepack.pack(w)
        run = lambda: prepack.packed_linear(x, packed)  # noqa: E731
    else:
        run = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(20):
        run()
    return time.perf_counter() - start


def is_native(dtype: torch.dtype) -> bool:
    """Whether 16-bit `dtype` matmuls beat fp32 ones here (so the weights stay 16-bit)."""
    try:  # the best of two rounds: the first 16-bit call also builds oneDNN's kernels
        half = min(_seconds(dtype) for _ in range(2))
        return half * NATIVE_SPEEDUP < min(_seconds(torch.float32) for _ in range(2))
    except RuntimeError:  # no bf16 kernel at all
        return False
