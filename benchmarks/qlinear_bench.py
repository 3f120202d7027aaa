"""Quantized linear kernels against what exists, on SmolLM2-135M's linears (issue 44).

Every linear of SmolLM2-135M (hidden 576, intermediate 1536, 30 layers: q/k/v/o/gate/up/down,
k and v 192 wide), each with its own random weights so that nothing runs from cache, in turn at 1,
16 and 64 rows of bfloat16 activations: milliseconds per full set (the sum of each linear's best
of N calls, N full sets apart: see _best_ms) and the weight bytes read per second, for
  * helios' qlinear (helios/engine/native/linear_q.cpp): int8 and int4, group 32 (Q8_0 / Q4_1's
    blocks) or --group, bfloat16 scales, on AVX-512 and on AVX2 (FLARE_QLINEAR_ISA), with float
    activations ("a32": the exact path) and with int8 activations ("a8": linear_qa.cpp, Q8_0-style
    activations and integer dot products, AVX512-VNNI or AVX2; llama.cpp's way);
  * helios' bfloat16 kernels (helios.engine.prepack: oneDNN and the native ones this host runs);
  * torch's stock int8 weight-only (aten._weight_int8pack_mm: per-channel scales, no groups) and
    int4 (aten._weight_int4pack_mm_for_cpu: group scales and zeros).

Usage: .venv/bin/python benchmarks/qlinear_bench.py [--rows 1 16 64] [--repeats 5] [--group 32]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.core import quant
from helios.engine import native, prepack

HIDDEN, INTERMEDIATE, LAYERS, KV = 576, 1536, 30, 192
SHAPES = (
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
)


@dataclass(frozen=True)
class Kernel:
    name: str
    bytes: int  # weight bytes one full set reads
    calls: list[Callable[[dict[int, Tensor]], object]]  # one per linear, in order, at the inputs by input size
    isa: str = ""  # FLARE_QLINEAR_ISA while it runs (qlinear only)


def _weights() -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=generator) * k**-0.5 for _ in range(LAYERS) for n, k in SHAPES]


def _qlinear(weights: list[Tensor], fmt: str, group: int, isa: str, act_bits: int = 32) -> Kernel:
    packed = []
    for w in weights:
        stored = quant.quantize(w, fmt, group, torch.bfloat16)
        packed.append(
            torch.ops.flare_native.pack_qlinear(
                stored[quant.QWEIGHT], stored[quant.SCALES], stored.get(quant.MINS), group, act_bits
            )
        )
    op = torch.ops.flare_native.qlinear
    calls = [lambda inputs, w=w, p=p: op(inputs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(weights, packed)]
    name = f"qlinear {quant.level(fmt, group)} a{act_bits} {isa}"
    return Kernel(name, sum(p.numel() for p in packed), calls, isa)


def _bf16(weights: list[Tensor], kernel: str) -> Kernel:
    bf16 = [w.to(torch.bfloat16) for w in weights]
    native_kernel = kernel in prepack.NATIVE_KERNELS
    packed = [torch.ops.flare_native.pack_linear(w) if native_kernel else prepack.pack(w) for w in bf16]

    if native_kernel:
        op = prepack.native_op(kernel)
        calls = [lambda inputs, w=w, p=p: op(inputs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(bf16, packed)]
    else:
        calls = [lambda inputs, w=w, p=p: prepack.packed_linear(inputs[w.shape[1]], p) for w, p in zip(bf16, packed)]
    return Kernel(f"bf16 {kernel}", sum(w.numel() * 2 for w in bf16), calls)


def _aten_int8(weights: list[Tensor]) -> Kernel:
    stored = []
    for w in weights:
        scales = w.abs().amax(1) / 127.0
        stored.append((torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales.to(torch.bfloat16)))

    op = torch.ops.aten._weight_int8pack_mm
    calls = [lambda inputs, q=q, s=s: op(inputs[q.shape[1]], q, s) for q, s in stored]
    return Kernel("aten int8pack_mm (per channel)", sum(q.numel() + s.numel() * 2 for q, s in stored), calls)


def _aten_int4(weights: list[Tensor], group: int) -> Kernel:
    stored = []
    for w in weights:
        q, scales, mins = quant.quantize_int4(w, group, torch.bfloat16)
        values = quant.unpack_int4(q).to(torch.int32)
        # torch's int4 value: (q - 8) * scale + zero, so zero = min + 8 * scale
        zeros = (mins.float() + 8 * scales.float()).to(torch.bfloat16)
        pair = torch.stack((scales, zeros), -1).transpose(0, 1).contiguous()  # [in / group, out, 2]
        stored.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2), pair, w.shape[1]))

    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    calls = [lambda inputs, p=p, pair=pair, k=k: op(inputs[k], p, group, pair) for p, pair, k in stored]
    total = sum(p.numel() + pair.numel() * 2 for p, pair, _ in stored)
    return Kernel(f"aten int4pack_mm_for_cpu g{group}", total, calls)


def _best_ms(kernel: Kernel, inputs: dict[int, Tensor], repeats: int) -> float:
    """Sum over the linears of each one's best-of-`repeats` call. A whole set runs between two calls
    of one linear, so its weights come from memory each time (as in a decode step); timing calls
    one by one keeps another process' time slice out of all but the unlucky calls, which the best
    of several drops (a whole set's tens of milliseconds is rarely left alone on a busy host)."""
    os.environ["FLARE_QLINEAR_ISA"] = kernel.isa
    best = [float("inf")] * len(kernel.calls)
    for repeat in range(repeats + 1):  # the first pass warms up
        for i, call in enumerate(kernel.calls):
            start = time.perf_counter()
            call(inputs)
            if repeat:
                best[i] = min(best[i], time.perf_counter() - start)
    return sum(best) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=32, choices=quant.GROUPS)
    parser.add_argument("--only", default="", help="run only the kernels whose name contains this")
    args = parser.parse_args()
    if not native.load() or not torch.ops.flare_native.has_qlinear():
        raise SystemExit(f"helios' native kernels do not run here ({native.status()}): nothing to measure")
    weights = _weights()
    builders: list[Callable[[], Kernel]] = []
    isas = [isa for isa in ("avx512", "avx2") if getattr(torch.ops.flare_native, f"has_qlinear_{isa}")()]
    for fmt in quant.FORMATS:
        builders += [
            lambda fmt=fmt, isa=isa, bits=bits: _qlinear(weights, fmt, args.group, isa, bits)
            for bits in (32, 8)
            for isa in isas
        ]
    builders += [lambda kernel=kernel: _bf16(weights, kernel) for kernel in (*prepack.native_kernels(), prepack.ONEDNN)]
    builders += [lambda: _aten_int8(weights), lambda: _aten_int4(weights, args.group)]
    print(f"SmolLM2-135M linears ({len(weights)} weights), {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'kernel':34s} {'MB':>7s} " + " ".join(f"{f'{r} rows ms':>11s} {'GB/s':>6s}" for r in args.rows))
    with torch.inference_mode():
        for build in builders:
            try:
                kernel = build()
            except RuntimeError as exc:  # a stock kernel this torch or CPU does not run
                print(f"(skipped: {str(exc).splitlines()[0][:100]})")
                continue
            if args.only not in kernel.name:
                continue
            cells = []
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES}
                ms = _best_ms(kernel, inputs, args.repeats)
                os.environ.pop("FLARE_QLINEAR_ISA", None)
                cells.append(f"{ms:11.2f} {kernel.bytes / ms / 1e6:6.1f}")
            print(f"{kernel.name:34s} {kernel.bytes / 1e6:7.1f} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
