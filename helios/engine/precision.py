"""Whether this host multiplies bfloat16 natively, measured rather than read from a flag list.

A bf16 core halves the bytes every decode step streams; on a CPU with AVX-512 BF16 or AMX
its matmuls are also faster. Without such units bf16 matmuls are emulated and run several
times slower than fp32 (seen: 19 vs 106 GFLOP/s), so there the weights are better upcast
once at load. The answer is kept per host (ISA, torch version, thread count) in the host
cache: measured on every start, a busy moment could flip it and leave a bf16 core running
upcast, several times slower, for the server's whole life.
"""

from __future__ import annotations

import time

import torch

from helios.core import hostcache
from helios.core.host import fingerprint
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
    key = f"{dtype}|{torch.get_num_threads()}|{fingerprint()}"
    known = hostcache.get("native-matmul", key)
    if isinstance(known, bool):
        return known
    try:  # best of three interleaved rounds: the first 16-bit call also builds oneDNN's kernels
        half, full = float("inf"), float("inf")
        for _ in range(3):
            half = min(half, _seconds(dtype))
            full = min(full, _seconds(torch.float32))
        native = half * NATIVE_SPEEDUP < full
    except RuntimeError:  # no bf16 kernel at all
        native = False
    hostcache.put("native-matmul", key, native)
    return native
