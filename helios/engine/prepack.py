"""CPU weight prepacking: the programs' linear layers run on packed weights.

ATen sends fp32 `linear` to MKL, whose small-batch GEMM and GEMV paths are several times
slower than oneDNN's on packed weights on many CPUs (measured here: 3-4x at 1-64 rows).
At load, every `aten.linear` whose weight is a program input is rewritten to a packed
linear; weights used only by linears are replaced by their packed form (no second copy),
and a weight shared with other ops (a tied embedding) keeps its plain tensor while the
linear reads a packed copy held by the program module.

Four packed kernels exist: oneDNN's, and helios' own (helios/engine/native), which read each
weight once per step at any row count from one packed layout (pack_linear): for bfloat16 weights
on CPUs with AVX512-BF16 `flare_native::linear` (pair dot products), on CPUs with AMX-BF16 the
same packed weights as AMX tiles (`flare_native::linear_tiles`), and on any x86-64 CPU with AVX2
and FMA `flare_native::linear_avx2`, which widens bfloat16 weights to fp32 in registers (there a
bfloat16 core streams half the bytes of an fp32 one where oneDNN would emulate bfloat16 slowly)
and also runs fp32 weights. Which one a core's linears use is measured on this host over the
core's own weight shapes at 1 and 32 rows (`choose`), remembered, and logged; export makes the
same measurement for the compiled step. A program uses one kernel at every row count, so a row's
result never depends on how many rows share its step.

FLARE_LINEAR_KERNEL=<kernel> (onednn, native, native-amx, native-avx2) skips the measurement and
uses that kernel where this host has it (tests and benchmarks compare kernels end to end with it).

The core's programs and weights are unchanged on disk: this is a runtime rewrite, like
registering faster kernels for the flare:: ops.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from functools import cache

import torch
from torch import Tensor, fx

from helios.core import hostcache
from helios.core.host import fingerprint
from helios.core.program import Program
from helios.engine import native
from helios.engine.rows import never_alone

log = logging.getLogger("helios.engine")

ONEDNN, NATIVE, NATIVE_TILES, NATIVE_AVX2 = "onednn", "native", "native-amx", "native-avx2"
NATIVE_KERNELS = (NATIVE, NATIVE_TILES, NATIVE_AVX2)  # all read pack_linear's layouts
OP_NAMES = {NATIVE: "linear", NATIVE_TILES: "linear_tiles", NATIVE_AVX2: "linear_avx2"}  # flare_native::
_ODD_INPUTS = (NATIVE_AVX2,)  # kernels that take weights with an odd number of input features
_FLOAT_WEIGHTS = (NATIVE_AVX2,)  # kernels that take float32 weights (the rest: bfloat16 only)
_CHOICE_ROWS = (1, 32)  # a decode step of one sequence, and of many
_SLOWER_AT_MANY_ROWS = 1.02  # a kernel this close to the best at 32 rows counts as as fast (noise)

_PACK_ROWS_HINT = 32  # oneDNN picks a blocking for this many rows; any row count runs


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` on a oneDNN-packed weight.

    oneDNN runs a one-row product on a GEMV kernel whose reduction order differs from its GEMM's
    (seen on fp32 weights with 1536 inputs: the last bits of every output), so a sequence decoded
    alone would not get the bits it gets beside others: a single row is never computed alone
    (rows.never_alone), and every call takes the GEMM path."""
    if x.numel() == x.shape[-1]:
        out = never_alone(
            lambda r: torch.ops.mkldnn._linear_pointwise(r, weight, bias, "none", [], ""), x.reshape(1, -1)
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)


def native_available() -> bool:
    return native.loaded() and bool(torch.ops.flare_native.has_bf16_linear())


def tiles_available() -> bool:
    return native_available() and bool(torch.ops.flare_native.has_amx_linear())


def avx2_available() -> bool:
    return native.loaded() and bool(torch.ops.flare_native.has_avx2_linear())


def native_kernels() -> list[str]:
    """helios' own linear kernels this host and build can run (none without the library)."""
    return [
        kernel
        for kernel, present in (
            (NATIVE, native_available()),
            (NATIVE_TILES, tiles_available()),
            (NATIVE_AVX2, avx2_available()),
        )
        if present
    ]


def forced() -> str | None:
    """The kernel FLARE_LINEAR_KERNEL names, or None (measure)."""
    value = os.environ.get("FLARE_LINEAR_KERNEL", "").strip().lower()
    if value and value not in (ONEDNN, *NATIVE_KERNELS):
        raise ValueError(f"FLARE_LINEAR_KERNEL={value!r}: choose one of {ONEDNN}, {', '.join(NATIVE_KERNELS)}")
    return value or None


def native_op(kernel: str):
    """The op of one of helios' kernels: op(x, packed, bias, out_features)."""
    return getattr(torch.ops.flare_native, OP_NAMES[kernel])


@cache
def onednn_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights here (it wants AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    ONEDNN_MAX_CPU_ISA=AVX2 says no too)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def takes(kernel: str, weight: Tensor) -> bool:
    """Whether `kernel` runs linears on this 2-D weight."""
    if kernel not in NATIVE_KERNELS:
        return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16())
    dtypes = (torch.bfloat16, torch.float32) if kernel in _FLOAT_WEIGHTS else (torch.bfloat16,)
    return weight.dtype in dtypes and (kernel in _ODD_INPUTS or weight.shape[1] % 2 == 0)


def _weight_uses(programs: list[Program], names: list[str]):
    """(program, weight node, its weights-dict key, user, whether the user is a linear reading it
    as its weight only), for every use of every weight input of the programs."""
    linear = torch.ops.aten.linear.default
    for program in programs:
        for node, name in _weight_inputs(program, names).items():
            for user in node.users:
                is_weight = user.target is linear and len(user.args) > 1 and user.args[1] is node
                yield program, node, name, user, is_weight and node not in user.args[:1] + user.args[2:]


def best_ms(run, repeats: int = 3) -> float:
    """Best-of-`repeats` milliseconds of run() after one warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


_SAMPLE_BYTES = 256 << 20  # measure over at least this much real weight (past any last-level cache), or all of it


def _pack_sample(kernel: str, sample: list[Tensor]) -> list[Tensor]:
    return [torch.ops.flare_native.pack_linear(w) if kernel in NATIVE_KERNELS else pack(w) for w in sample]


def _measure(kernel: str, rows: int, sample: list[Tensor], packed: list[Tensor]) -> float:
    """Best-of-three milliseconds for `sample`'s linears (packed for `kernel`), in order, at `rows` rows."""
    native_kernel = kernel in NATIVE_KERNELS
    dtype = sample[0].dtype  # a core's activations have its weights' dtype
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in sample}}
    op = native_op(kernel) if native_kernel else None

    def run() -> None:
        for w, p in zip(sample, packed):
            if native_kernel:
                op(inputs[w.shape[1]], p, None, w.shape[0])
            else:
                packed_linear(inputs[w.shape[1]], p)

    with torch.inference_mode():
        return best_ms(run)


def linear_weights(programs: list[Program], weights: dict[str, Tensor]) -> list[str]:
    """The 2-D weights the programs' linears read as their weight, in program order."""
    uses = _weight_uses(programs, list(weights))
    return list(dict.fromkeys(name for _, _, name, _, of_linear in uses if of_linear and weights[name].dim() == 2))


def measure_linears(kernel: str, rows: int, weights: list[Tensor]) -> float:
    """Best-of-three milliseconds for these linears in turn on `kernel` at `rows` rows (benchmarks)."""
    return _measure(kernel, rows, weights, _pack_sample(kernel, weights))


def choose(programs: list[Program], weights: dict[str, Tensor]) -> str:
    """The packed-linear kernel for these programs' bfloat16 linears on this host, or where there are
    none (an fp32 core), their float32 ones.

    Each candidate that takes every such weight (oneDNN where it packs them; the native kernel
    where AVX512-BF16 is there and its AMX-tile form where AMX-BF16 is, for bfloat16 weights; the
    AVX2 kernel where AVX2 and FMA are) is timed over the core's own linear weights in program
    order (up to 256 MiB of them, so no kernel runs from cache) at one row and at 32 rows. Of the
    candidates within 2% of the fastest at 32 rows, the fastest at one row wins. Measured once
    per host, torch, thread count, weight dtype and weight set (a second or two), then remembered."""
    linears = linear_weights(programs, weights)  # a 16-bit core's own (its few fp32 ones, e.g. a router, follow)
    names = [n for n in linears if weights[n].dtype == torch.bfloat16] or [
        n for n in linears if weights[n].dtype == torch.float32
    ]
    candidates = [k for k in (*native_kernels(), ONEDNN) if all(takes(k, weights[n]) for n in names)]
    if not names or candidates in ([], [ONEDNN]):  # nothing to choose: oneDNN packs what it takes
        return ONEDNN
    if len(candidates) == 1:
        log.info("linear layers on %s: the only kernel here for these weights", describe(candidates[0]))
        return candidates[0]
    wanted = forced()
    if wanted is not None:
        if wanted in candidates:
            log.info("linear layers on %s: FLARE_LINEAR_KERNEL (not measured)", describe(wanted))
            return wanted
        log.warning("FLARE_LINEAR_KERNEL=%s does not run here (%s do): measuring", wanted, ", ".join(candidates))
    shapes = Counter(tuple(weights[n].shape) for n in names)
    # The candidates are part of the key: a choice made before a kernel existed is not reused.
    dtype = str(weights[names[0]].dtype).removeprefix("torch.")
    key = f"{sorted(shapes.items())}|{dtype}|{torch.get_num_threads()}|{fingerprint()}|{','.join(candidates)}"
    remembered = hostcache.get("linear-kernel", key)
    if isinstance(remembered, str):  # a choice remembered before its figures were kept with it
        remembered = {"kernel": remembered}
    if isinstance(remembered, dict) and remembered.get("kernel") in candidates:
        log.info(_why(remembered, "measured before on this host"))
        return remembered["kernel"]
    sample, total = [], 0
    for name in names:
        if total >= _SAMPLE_BYTES:
            break
        sample.append(weights[name])
        total += weights[name].numel() * weights[name].element_size()
    timings: dict[tuple[str, int], float] = {}
    for kernel in candidates:
        packed = _pack_sample(kernel, sample)
        for rows in _CHOICE_ROWS:
            timings[(kernel, rows)] = _measure(kernel, rows, sample, packed)
        del packed
    few, many = _CHOICE_ROWS
    best_many = min(timings[(kernel, many)] for kernel in candidates)
    close = [kernel for kernel in candidates if timings[(kernel, many)] <= _SLOWER_AT_MANY_ROWS * best_many]
    choice = min(close, key=lambda kernel: timings[(kernel, few)])
    measured = {
        "kernel": choice,
        "megabytes": round(total / 1e6),
        "ms": {kernel: [round(timings[(kernel, rows)], 2) for rows in _CHOICE_ROWS] for kernel in candidates},
    }
    log.info(_why(measured, "measured now"))
    hostcache.put("linear-kernel", key, measured)
    return choice


_DESCRIPTIONS = {
    ONEDNN: "oneDNN's packed matmul",
    NATIVE: "helios' AVX512-BF16 kernel",
    NATIVE_TILES: "helios' AMX-BF16 tiles",
    NATIVE_AVX2: "helios' AVX2+FMA kernel (float32 arithmetic; bfloat16 weights widened in registers)",
}


def describe(kernel: str) -> str:
    """The kernel's name and what it is, for people reading the startup log."""
    return f"{kernel}, {_DESCRIPTIONS.get(kernel, 'a packed kernel')}"


def _why(measured: dict, when: str) -> str:
    """The startup line of choose(): the kernel, and the figures it won on ({"kernel", "megabytes",
    "ms": {kernel: [ms at 1 row, ms at 32 rows]}}; a choice remembered without them says so)."""
    choice, figures = measured["kernel"], measured.get("ms")
    if not figures:
        return f"linear layers on {describe(choice)}: {when}"
    few, many = _CHOICE_ROWS

    def row(index: int, rows: int) -> str:
        others = ", ".join(f"{k} {ms[index]:.1f}" for k, ms in figures.items() if k != choice)
        return f"{rows} row{'s' if rows > 1 else ''} {figures[choice][index]:.1f} ms ({others})"

    return (
        f"linear layers on {describe(choice)}: {when} over {measured.get('megabytes', '?')} MB of this core's weights, "
        f"the fastest at {few} row of those within {round((_SLOWER_AT_MANY_ROWS - 1) * 100)}% of the fastest at "
        f"{many} rows: {row(0, few)}; {row(1, many)}"
    )


def _weight_inputs(program: Program, names: list[str]) -> dict[fx.Node, str]:
    """Placeholder node -> weights-dict key, for the program's leading weight inputs."""
    placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders[: len(names)], names, strict=True))


def prepack(programs: list[Program], weights: dict[str, Tensor], kernel: str = ONEDNN) -> dict[str, Tensor]:
    """Rewrite the programs' linears in place; returns the weights dict to call them with.

    All programs must take `weights` (same keys, same order) as their first input. kernel:
    ONEDNN for every float32/bfloat16 linear it takes, or one of NATIVE_KERNELS for the ones it
    takes (choose(); `takes` says which weights).
    """
    native_kernel = kernel in NATIVE_KERNELS
    packable = {name for name, w in weights.items() if w.dim() == 2 and takes(kernel, w)}
    linear_only = set(packable)
    rewrites: list[tuple[Program, fx.Node, str]] = []
    for program, _, name, user, of_linear in _weight_uses(programs, list(weights)):
        if of_linear and name in packable:
            rewrites.append((program, user, name))
        else:
            linear_only.discard(name)
    if not rewrites:
        return weights
    packer = torch.ops.flare_native.pack_linear if native_kernel else pack
    packed = {name: packer(weights[name]) for name in {name for _, _, name in rewrites}}
    for program in {id(p): p for p, _, _ in rewrites}.values():
        module = program.module
        for _, node, name in (r for r in rewrites if r[0] is program):
            weight = node.args[1]
            if name not in linear_only:  # shared with other ops: the linear reads a copy
                attr = "_helios_packed_" + name.replace(".", "_")
                module.register_buffer(attr, packed[name], persistent=False)
                with module.graph.inserting_before(node):
                    weight = module.graph.get_attr(attr)
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if native_kernel:
                node.target = native_op(kernel).default
                node.args, node.kwargs = (node.args[0], weight, bias, int(weights[name].shape[0])), {}
            else:
                node.target = packed_linear
                node.args = (node.args[0], weight, *node.args[2:])
        module.graph.lint()
        module.recompile()
    # Weights no loaded program reads (a drafter's, e.g. MiMo's MTP layers) stay as they are.
    return {name: packed[name] if name in linear_only and name in packed else w for name, w in weights.items()}
