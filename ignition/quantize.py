"""export --quantize: which weights a core stores at 8 or 4 bits, and their stored tensors.

The layout is helios.core.quant's. Quantized are the weights the programs read only as a
linear's weight (`aten.linear`: attention projections, MLPs) or as the expert stacks of
`flare::routed_experts` - found from the saved programs themselves, not from names - because
helios runs exactly those on its quantized kernels. MoE routers (the linears an expert choice is
computed from) stay float. The vocabulary tables (a [vocab, ...] weight
read as an embedding and/or as the output head) are quantized only when asked
(--quantize-embeddings, --quantize-head; a tied table needs both). A weight the vision program
reads stays float (towers run once per image). A weight whose input size is not a multiple of the
group stays float and is named in the export's progress line.

A GGUF source whose tensors are Q8_0 / Q4_0 / Q4_1 / Q4_K keeps their grid (gguf_grids; 4-bit
blocks only where int4 was asked for, never fewer bits than asked): each
weight's groups are read back from its group-id map and kept when they reproduce its float32
values exactly; otherwise (other block types, or a family conversion that moved values within
a row) the weight is requantized and the largest error is reported (QuantSelfCheck.requantized).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, fx

from helios.core import manifest as mf
from helios.core import quant
from helios.core.program import VISION, Program
from ignition.errors import UsageError
from ignition.models.family import Family
from ignition.sources import Checkpoint
from ignition.sources import gguf_grids as grids_

SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEAR, EXPERTS, ROUTER, OTHER = "linear", "experts", "router", "other"
_EXPERT_STACKS = (3, 4)  # flare::routed_experts' w_gate_up and w_down arguments
_EXPERT_KWARGS = ("w_gate_up", "w_down")


@dataclass(frozen=True, slots=True)
class QuantRequest:
    """What `ignition export --quantize` asked for."""

    format: str  # quant.INT8 | quant.INT4
    group: int = 32  # values per scale along the inputs (quant.GROUPS)
    scale_dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    embeddings: bool = False  # also the embedding table
    head: bool = False  # also the output head
    # --quant-activations: "float" (exact products of the stored values) or "int8" (the linears'
    # activations quantized per 32-feature block, as llama.cpp's Q8_0: faster, recorded per tensor)
    activations: str = quant.FLOAT_ACTIVATIONS


@dataclass(frozen=True)
class Quantized:
    """The quantized export's weights: what the file stores, and what the programs compute with."""

    stored: dict[str, Tensor]  # weights.safetensors: float weights as they are, quantized ones as their parts
    program: dict[str, Tensor]  # the programs' weights with each quantized one dequantized to its dtype
    tensors: dict[str, mf.QuantizedTensor]
    requantized: dict[str, float]  # weight -> max |error| where quantized source blocks had no core layout
    kept_float: dict[str, int]  # weight -> its input size (not a multiple of the group)


def check(request: QuantRequest | None, tensor_parallel: tuple[int, ...], host: bool) -> None:
    """Refuse what --quantize cannot be combined with (those paths read float weights)."""
    if request is None:
        return
    if request.format not in quant.FORMATS:
        raise UsageError(f"--quantize must be one of {', '.join(quant.FORMATS)}, got {request.format!r}")
    if request.group not in quant.GROUPS:
        raise UsageError(f"--quant-group must be one of {', '.join(map(str, quant.GROUPS))}, got {request.group}")
    if request.scale_dtype not in SCALE_DTYPES:
        raise UsageError(f"--quant-scales must be one of {', '.join(SCALE_DTYPES)}, got {request.scale_dtype!r}")
    if request.activations not in quant.ACTIVATIONS:
        raise UsageError(
            f"--quant-activations must be one of {', '.join(quant.ACTIVATIONS)}, got {request.activations!r}"
        )
    for flag, on in (
        ("--tensor-parallel above 1", max(tensor_parallel) > 1),
        ("--host-embeddings", host),
    ):
        if on:
            raise UsageError(
                f"--quantize does not combine with {flag} yet (that path reads float weights); "
                "export without one of them"
            )


# ---------------------------------------------------------------------------- which weights


def _use(user: fx.Node, node: fx.Node) -> str:
    """How `user` reads weight input `node`."""
    args = list(user.args)
    elsewhere = [a for a in user.kwargs.values() if a is node]
    if user.target is torch.ops.aten.linear.default:
        if len(args) > 1 and args[1] is node and node not in args[:1] + args[2:] and not elsewhere:
            return LINEAR
        return OTHER
    if user.target is torch.ops.flare.routed_experts.default:
        at = [i for i, a in enumerate(args) if a is node]
        named = [k for k, a in user.kwargs.items() if a is node]
        if all(i in _EXPERT_STACKS for i in at) and all(k in _EXPERT_KWARGS for k in named):
            return EXPERTS
    return OTHER


def _ancestors(start: fx.Node) -> set[fx.Node]:
    seen, stack = {start}, [start]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _routers(graph: fx.Graph) -> set[fx.Node]:
    """The weight inputs of each routed_experts call's routing (the linears its expert ids and weights
    come from, past its input h): kept float, like llama.cpp's ffn_gate_inp - a rounded router
    flips near-tied expert choices."""
    found: set[fx.Node] = set()
    for call in graph.nodes:
        if call.target is not torch.ops.flare.routed_experts.default:
            continue
        stop = _ancestors(call.args[0])  # type: ignore[arg-type]
        stack = [a for a in call.args[1:3] if isinstance(a, fx.Node) and a not in stop]
        seen = set(stack)
        while stack:
            node = stack.pop()
            if node.target is torch.ops.aten.linear.default and len(node.args) > 1:
                found.add(node.args[1])  # type: ignore[arg-type]
            for parent in node.all_input_nodes:
                if parent not in seen and parent not in stop:
                    seen.add(parent)
                    stack.append(parent)
    return found


def weight_uses(programs: list[Program], names: list[str]) -> dict[str, set[str]]:
    """Weight -> the kinds of reads of it (LINEAR, EXPERTS, ROUTER, OTHER) over every program, each
    taking the weights dict (in `names` order) as its leading inputs."""
    uses: dict[str, set[str]] = {name: set() for name in names}
    for program in programs:
        placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
        routers = _routers(program.module.graph)
        for node, name in zip(placeholders[: len(names)], names, strict=True):
            uses[name].update(_use(user, node) for user in node.users)
            if node in routers:
                uses[name].add(ROUTER)
    return uses


def selected(
    request: QuantRequest, config: object, uses: dict[str, set[str]], weights: dict[str, Tensor], towers: set[str]
) -> tuple[list[str], dict[str, int]]:
    """(weights to quantize, weights kept float because their input size is not a multiple of the group)."""
    vocab = int(config.vocab_size)  # type: ignore[attr-defined]
    chosen: list[str] = []
    kept: dict[str, int] = {}
    for name, w in weights.items():
        kinds = uses[name]
        if not kinds or not w.is_floating_point() or name in towers:
            continue
        if w.dim() == 2 and w.shape[0] == vocab:  # the vocabulary: embedding table and/or output head
            if EXPERTS in kinds:
                continue
            if (kinds - {LINEAR} and not request.embeddings) or (LINEAR in kinds and not request.head):
                continue
        elif not (kinds == {LINEAR} and w.dim() == 2 or kinds == {EXPERTS} and w.dim() == 3):
            continue
        if w.shape[-1] % request.group:
            kept[name] = int(w.shape[-1])
            continue
        chosen.append(name)
    return chosen, kept


# ---------------------------------------------------------------------------- grids kept from a GGUF


def source_grid(values: Tensor, ids: Tensor, grids: grids_.SourceGrids) -> tuple[dict[str, Tensor], str] | None:
    """The stored tensors of a weight on the grid its source blocks had, and the origin ("gguf Q4_1"),
    when every group of 32 inputs came from one block group of a kept kind and the grid reproduces
    the float32 values exactly; None otherwise."""
    group = grids_.GROUP
    if values.shape[-1] % group:
        return None
    by_group = ids.reshape(*ids.shape[:-1], ids.shape[-1] // group, group)
    first = by_group[..., 0]
    if bool((first < 0).any()) or not torch.equal(by_group, first[..., None].expand_as(by_group)):
        return None
    index = first.long()
    kinds = grids.kinds[index]
    kind = int(kinds.reshape(-1)[0])
    if kind == grids_.NONE or not bool((kinds == kind).all()):
        return None
    scales, mins = grids.scales[index], grids.mins[index]
    g = values.float().reshape(by_group.shape)
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))[..., None]
    if kind == grids_.INT8:
        q = torch.where(scales[..., None] != 0, torch.round(g / safe), torch.zeros_like(g))
        if bool((q.abs() > 127).any()):
            return None
        stored = {quant.QWEIGHT: q.reshape(values.shape).to(torch.int8), quant.SCALES: scales}
        back = quant.dequantize(stored[quant.QWEIGHT], scales, None, group)
    else:
        q = torch.where(scales[..., None] != 0, torch.round((g - mins[..., None]) / safe), torch.zeros_like(g))
        if bool(((q < 0) | (q > 15)).any()):
            return None
        packed = quant.pack_int4(q.reshape(values.shape))
        stored = {quant.QWEIGHT: packed, quant.SCALES: scales, quant.MINS: mins}
        back = quant.dequantize(packed, scales, mins, group)
    if not torch.equal(back, values.float()):
        return None
    types = sorted({grids.type_names[int(t)] for t in grids.types[index].unique()})
    return stored, "gguf " + "+".join(types)


def _internal_ids(
    fam: Family, config: object, checkpoint: Checkpoint, internal: Callable[..., dict[str, Tensor]]
) -> tuple[grids_.SourceGrids, dict[str, Tensor]] | None:
    """The source's grids and each internal weight's group-id map (the values' conversions run on
    the maps), or None when the source keeps no grid or a conversion cannot carry the maps."""
    if checkpoint.grids is None or fam.canonical_tensors is not None:  # (no GGUF family rewrites its layout)
        return None
    grids = checkpoint.grids()
    if not grids.ids:
        return None
    maps = {
        name: grids.ids.get(name, torch.full(t.shape, -1, dtype=torch.int32)) if t.is_floating_point() else t
        for name, t in checkpoint.tensors.items()
    }
    try:
        return grids, internal(fam, replace(checkpoint, tensors=maps), config, torch.float32)
    except (RuntimeError, ValueError, TypeError):
        return None  # a conversion that computes with values: requantize (reported)


# ---------------------------------------------------------------------------- quantizing


def prepare(
    request: QuantRequest | None,
    fam: Family,
    config: object,
    checkpoint: Checkpoint,
    weights: dict[str, Tensor],
    specs: dict[str, mf.ProgramSpec],
    staging: Path,
    internal: Callable[..., dict[str, Tensor]],
    progress: Callable[[str], None],
) -> Quantized | None:
    """The quantized weights of an export (None without --quantize). `checkpoint` is the source as
    the family reads it (after its canonical_tensors), `internal` ignition.export.internal_weights."""
    if request is None:
        return None
    names = list(weights)
    programs = [Program.load(kind, spec, staging / spec.file) for kind, spec in specs.items() if kind != VISION]
    uses = weight_uses(programs, names)
    towers: set[str] = set()
    if VISION in specs:
        vision = weight_uses([Program.load(VISION, specs[VISION], staging / specs[VISION].file)], names)
        towers = {name for name, kinds in vision.items() if kinds}
    chosen, floats = selected(request, config, uses, weights, towers)
    level = quant.level(request.format, request.group, request.activations)
    note = "; kept float: " + ", ".join(f"{n} ({k} inputs)" for n, k in floats.items()) if floats else ""
    progress(f"quantizing {len(chosen)} weights to {level}{note}")
    found = _internal_ids(fam, config, checkpoint, internal) if checkpoint.grids is not None else None
    exact = weights
    if found is not None and any(weights[n].dtype != torch.float32 for n in chosen):
        exact = internal(fam, checkpoint, config, torch.float32)  # the source's own values, for the grids
    scale_dtype = SCALE_DTYPES[request.scale_dtype]
    stored = dict(weights)
    for name in chosen:
        del stored[name]  # stored as its parts instead
    program = dict(weights)
    records: dict[str, mf.QuantizedTensor] = {}
    requantized: dict[str, float] = {}
    for name in chosen:
        values = exact[name]
        ids = found[1].get(name) if found is not None else None
        grid = source_grid(values, ids, found[0]) if found is not None and ids is not None else None
        if grid is not None and request.format == quant.INT8 and quant.MINS in grid[0]:
            grid = None  # a 4-bit block where 8 bits were asked for: requantized, never fewer bits than asked
        if grid is not None:
            parts, origin = grid
            fmt = quant.INT8 if quant.MINS not in parts else quant.INT4
            group, dtype_name = grids_.GROUP, "float32"
        else:
            parts = quant.quantize(values, request.format, request.group, scale_dtype)
            fmt, group, dtype_name, origin = request.format, request.group, request.scale_dtype, "export"
            if not all(bool(torch.isfinite(parts[p]).all()) for p in (quant.SCALES, quant.MINS) if p in parts):
                raise UsageError(
                    f"{name}: its scales overflow --quant-scales {request.scale_dtype} (weights beyond its range); "
                    "export with --quant-scales float32 or bfloat16"
                )
        value = quant.dequantize(parts[quant.QWEIGHT], parts[quant.SCALES], parts.get(quant.MINS), group)
        if grid is None and ids is not None and bool((ids >= 0).any()):
            requantized[name] = float((value - values.float()).abs().max())  # quantized blocks requantized
        for suffix, tensor in parts.items():
            stored[name + suffix] = tensor.contiguous()
        program[name] = value.to(weights[name].dtype)
        records[name] = mf.QuantizedTensor(
            format=fmt,
            group=group,
            scale_dtype=dtype_name,
            shape=tuple(int(d) for d in values.shape),
            dtype=str(weights[name].dtype).removeprefix("torch."),
            origin=origin,
            activations=activations_of(request, uses[name], values.dim()),
        )
    return Quantized(stored=stored, program=program, tensors=records, requantized=requantized, kept_float=floats)


def activations_of(request: QuantRequest, kinds: set[str], dims: int) -> str:
    """What a quantized weight's linears multiply it by: int8 activations where asked for and the
    weight is a 2-D linear's weight (a tied vocabulary table also read by its embedding lookup, which
    helios gathers from the same blob, included); expert stacks keep float activations."""
    if request.activations == quant.INT8_ACTIVATIONS and LINEAR in kinds and EXPERTS not in kinds and dims == 2:
        return quant.INT8_ACTIVATIONS
    return quant.FLOAT_ACTIVATIONS


def file_tensors(quantized: Quantized | None, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """What weights.safetensors holds."""
    return quantized.stored if quantized is not None else weights


def level_of(tensors: dict[str, mf.QuantizedTensor]) -> str:
    """The core's precision name: its levels (quant.level), the most used first, joined by "+"
    (e.g. "int4-g32+int8-g32": int4 linears and an int8 head kept from a GGUF's Q8_0 table)."""
    counts = Counter(quant.level(t.format, t.group, t.activations) for t in tensors.values())
    return "+".join(sorted(counts, key=lambda name: (-counts[name], name)))


def format_version(quantization: mf.Quantization | None, compiled: bool = False, native_topk: bool = False) -> int:
    """The oldest version that describes the core, so that older helios keeps reading what it can:
    5 for a compiled step that needs version 5's native kernels (int8-activation weights packed
    with their scales beside them: native/linear_qa.h; its top-k op: native/topk.cpp), 4 for
    float16 scales, 3 for other quantized cores, 2 for every other core."""
    tensors = quantization.tensors.values() if quantization is not None else ()
    if compiled and (native_topk or any(t.activations == "int8" for t in tensors)):
        return 5
    if quantization is None:
        return 2
    return 4 if any(t.scale_dtype == "float16" for t in tensors) else 3


def sized(quantized: Quantized | None, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """`weights` with each quantized weight standing in as a [..., out, stored bytes per row] uint8
    (meta) tensor, so a family's decode_weight_bytes counts the bytes a decode step reads."""
    if quantized is None:
        return weights
    out = dict(weights)
    for name, record in quantized.tensors.items():
        scale = SCALE_DTYPES[record.scale_dtype]
        per_row = quant.stored_bytes((record.shape[-1],), record.format, record.group, scale)
        out[name] = torch.empty((*record.shape[:-1], per_row), dtype=torch.uint8, device="meta")
    return out


__all__ = [
    "QuantRequest",
    "Quantized",
    "activations_of",
    "check",
    "file_tensors",
    "format_version",
    "level_of",
    "prepare",
    "selected",
    "sized",
    "source_grid",
    "weight_uses",
]
