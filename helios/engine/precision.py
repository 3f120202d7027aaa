"""Whether a 16-bit core keeps its weights 16-bit on this host, measured rather than read from a
flag list or a CPU model name.

A bf16 core halves the bytes every decode step streams. On a CPU with AVX-512 BF16 or AMX its
matmuls are also faster; without such units oneDNN emulates bf16 matmuls several times slower
than fp32 (seen: 19 vs 106 GFLOP/s). helios' own AVX2 kernel (helios/engine/native,
linear_avx2.cpp) widens bf16 weights to fp32 in registers instead, so on an AVX2-only CPU a bf16
core reads half the bytes at fp32 arithmetic speed. A core is upcast to fp32 at load only where
no bf16 kernel is competitive with fp32 oneDNN:

* oneDNN's bf16 matmul beats its fp32 one (a small product from cache: the arithmetic); or
* one of helios' bf16 kernels, over weights past the last-level cache, beats fp32 oneDNN at one
  row (a decode step of one sequence: the bytes) and is at most `MANY_ROWS_SLOWER` slower at 32
  rows (many sequences: the arithmetic).

FLARE_LINEAR_KERNEL naming one of helios' bf16 kernels (helios/engine/prepack.py) keeps bf16
weights without measuring. The answer is kept per host (ISA, torch version, thread count, the kernels there are) in the
host cache: measured on every start, a busy moment could flip it and leave a bf16 core running
upcast, slower, for the server's whole life.
"""

from __future__ import annotations

import logging
import time

import torch

from helios.core import hostcache
from helios.core.host import fingerprint
from helios.engine import native, prepack

log = logging.getLogger("helios.engine")

_ROWS, _IN, _OUT = 8, 1024, 2048
NATIVE_SPEEDUP = 1.1  # bf16 must beat fp32 by this factor to count as native
MANY_ROWS_SLOWER = 1.25  # a helios bf16 kernel may be this much slower than fp32 at 32 rows
_STREAM_BYTES = 96 << 20  # fp32 bytes of the streamed comparison (past a last-level cache)
_STREAM_ROWS = (1, 32)


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


def _onednn_native(dtype: torch.dtype) -> bool:
    try:  # best of three interleaved rounds: the first 16-bit call also builds oneDNN's kernels
        half, full = float("inf"), float("inf")
        for _ in range(3):
            half = min(half, _seconds(dtype))
            full = min(full, _seconds(torch.float32))
        return half * NATIVE_SPEEDUP < full
    except RuntimeError:  # no bf16 kernel at all
        return False


def _streamed_ms(kernel: str, weights: list[torch.Tensor]) -> dict[int, float]:
    """Milliseconds for `kernel` (one of helios' kernels on bf16 copies, or oneDNN on fp32) over
    `weights` in turn, at each of _STREAM_ROWS rows."""
    if kernel in prepack.NATIVE_KERNELS:
        op = prepack.native_op(kernel)
        packed = [torch.ops.flare_native.pack_linear(w.to(torch.bfloat16)) for w in weights]
        dtype = torch.bfloat16
        call = lambda x, p, n: op(x, p, None, n)  # noqa: E731
    else:
        packed = [prepack.pack(w) for w in weights]
        dtype = torch.float32
        call = lambda x, p, n: prepack.packed_linear(x, p)  # noqa: E731
    times = {}
    with torch.inference_mode():
        for rows in _STREAM_ROWS:
            x = torch.randn(rows, _IN).to(dtype)
            times[rows] = prepack.best_ms(lambda x=x: [call(x, p, w.shape[0]) for p, w in zip(packed, weights)])
    return times


def _helios_competitive() -> str | None:
    """The first of helios' bf16 kernels competitive with fp32 oneDNN here (module docstring), or None."""
    kernels = prepack.native_kernels()
    if not kernels or not prepack.available():
        return None
    weights = [torch.randn(_OUT, _IN) for _ in range(max(1, _STREAM_BYTES // (_OUT * _IN * 4)))]
    full = _streamed_ms(prepack.ONEDNN, weights)
    few, many = _STREAM_ROWS
    for kernel in kernels:
        half = _streamed_ms(kernel, weights)
        log.info(
            "bf16 weights: %s %.1f / %.1f ms at %d / %d rows, fp32 oneDNN %.1f / %.1f ms",
            kernel,
            half[few],
            half[many],
            few,
            many,
            full[few],
            full[many],
        )
        if half[few] * NATIVE_SPEEDUP < full[few] and half[many] <= MANY_ROWS_SLOWER * full[many]:
            return kernel
    return None


def is_native(dtype: torch.dtype) -> bool:
    """Whether 16-bit `dtype` weights stay 16-bit here: some kernel for them (oneDNN's, or for
    bfloat16 helios' own) is competitive with fp32 (module docstring)."""
    helios = prepack.native_kernels() if dtype == torch.bfloat16 and native.load() else []
    if prepack.forced() in helios:  # FLARE_LINEAR_KERNEL names a bf16 kernel this host has
        return True
    key = f"{dtype}|{torch.get_num_threads()}|{fingerprint()}|{','.join(helios)}"
    known = hostcache.get("native-matmul", key)
    if isinstance(known, bool):
        return known
    keep = _onednn_native(dtype) or (bool(helios) and _helios_competitive() is not None)
    hostcache.put("native-matmul", key, keep)
    return keep
