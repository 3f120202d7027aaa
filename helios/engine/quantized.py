"""Quantized weights at load (manifest.quantization): run on the stored values, or dequantize.

A quantized core's programs were traced with float weights; its weights file holds some of them
group-wise quantized (helios.core.quant). At load, for each such weight:

* **native**: every use in the programs the engine rewrites (step, scored prefill, drafters) is a
  linear's weight (`aten.linear`, 2-D), an embedding table (`aten.embedding`: its rows gathered
  from the packed blob, `embedding_rows`) or an expert stack of `flare::routed_experts` whose two
  stacks both run natively, the engine runs on the CPU, and the native library has the quantized
  kernels on this host (`flare_native::has_qlinear`). The weights-dict entry becomes the packed
  blob of `flare_native::pack_qlinear` (per expert for a stack: [E, bytes]) and the uses are
  rewritten: linears to `flare_native::qlinear(x, packed, bias, out_features)`, expert calls to
  helios' quantized expert kernel (kernels.moe.routed_experts_quantized). The stored tensors are
  dropped once packed: no float copy of the weight exists.
* **dequantized** otherwise, to the dtype the programs take the weight in (float32 where the
  engine runs a 16-bit core upcast), with the reason logged once: a GPU device, no native kernel
  here, or another use (a vision tower's program, a stack whose partner is dequantized).

Activations: a weight recorded with int8 activations (manifest QuantizedTensor.activations,
`ignition export --quant-activations int8`) is packed for the int8-activation kernel
(pack_qlinear's act_bits=8: native/linear_qa.h), which quantizes each row of a linear's input per
32-feature block as llama.cpp's Q8_0 does and multiplies integers. Where such a weight is
dequantized instead, its linears' inputs are rounded the same way first
(quantized_ref.fake_quantize), so every path computes what the core's self-check measured. Cores
without the field (or with "float") run the exact float-activation kernel as before.

Runs before graph.simplify and prepack: prepack packs bfloat16/float32 linears only, so the
rewritten quantized linears keep their kernel. The core's programs and weights are unchanged on
disk: this is a runtime rewrite like prepack's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from helios.core import quant
from helios.core.bundle import StoredWeight
from helios.core.manifest import Quantization
from helios.core.program import Program
from helios.engine import quantized_ref
from helios.engine.kernels import moe

log = logging.getLogger("helios.engine")

_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default
_HEADER_WORDS = 8  # the packed blob's header: magic, bits, group, in, out, blocks, scale bytes and type, block_bytes
_SCALE_TYPES = (torch.float32, torch.bfloat16, torch.float16)  # native/linear_q.h: ScaleType
_BLOCK = 16  # outputs per block of the packed layout (native/linear_q.h)
# The int8-activation layouts (native/linear_qa.h): "FLQ9", scales beside their groups' weights, and
# "FLQ8", earlier builds' (a block's scales in one region; a compiled step holds its blobs, so still read).
_MAGIC_A8 = 0x39514C46
_MAGIC_A8_REGION = 0x38514C46
_MAGICS_A8 = (_MAGIC_A8, _MAGIC_A8_REGION)
_ACT_BLOCK = 32  # features per activation block of that layout
# flare::routed_experts as exported, and as graph.simplify retargets it (either may be seen).
_EXPERTS = (torch.ops.flare.routed_experts.default, moe.routed_experts_cpu)
_STACKS = {3: "gate_up_features", 4: "down_features"}  # routed_experts' stack arguments -> out-features kwarg


@dataclass(frozen=True, slots=True)
class QuantizedLoad:
    """What the engine made of a core's quantized weights (discovery and the startup line)."""

    level: str  # manifest.quantization.level, e.g. "int4-g32"
    native: tuple[str, ...]  # weights whose linears run on the stored values
    dequantized: tuple[str, ...]  # weights dequantized at load
    dtype: str  # the float dtype dequantized weights are held in
    reasons: tuple[str, ...]  # why each group of weights was dequantized (empty when none was)

    @property
    def in_memory(self) -> str:
        """The weight precision the engine holds: the level, the float dtype, or both."""
        if not self.dequantized:
            return self.level
        if not self.native:
            return self.dtype
        total = len(self.native) + len(self.dequantized)
        return f"{self.level} ({len(self.dequantized)} of {total} quantized tensors dequantized to {self.dtype})"


def dequantized_growth(quantization: Quantization | None) -> int:
    """Bytes a device holds beyond the weights file's when every quantized weight is dequantized
    there (a GPU: the KV pool is sized from the memory the weights leave)."""
    if quantization is None:
        return 0
    return sum(
        math.prod(t.shape) * getattr(torch, t.dtype).itemsize
        - quant.stored_bytes(t.shape, t.format, t.group, getattr(torch, t.scale_dtype))
        for t in quantization.tensors.values()
    )


def has_qlinear() -> bool:
    """Whether the native library here has the quantized linear kernels and this host runs them."""
    try:
        check = torch.ops.flare_native.has_qlinear
        torch.ops.flare_native.pack_qlinear  # noqa: B018
        torch.ops.flare_native.qlinear  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return bool(check())


@dataclass(frozen=True, slots=True)
class _Use:
    program: Program
    node: fx.Node  # the user
    argument: int  # which positional argument of the user the weight is (-1: a keyword or several)
    kind: str  # "linear", "experts" or what else reads it


def _uses(programs: list[Program], names: list[str], wanted: set[str]) -> Iterator[tuple[str, _Use]]:
    """(weight name, use) for every use of a wanted weight input of the programs."""
    for program in programs:
        placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
        for node, name in zip(placeholders[: len(names)], names, strict=True):
            if name not in wanted:
                continue
            for user in node.users:
                positions = [i for i, a in enumerate(user.args) if a is node]
                inside = node in user.kwargs.values() or len(positions) != 1
                argument = -1 if inside else positions[0]
                if user.target is _LINEAR and argument == 1:
                    kind = "linear"
                elif user.target in _EXPERTS and argument in _STACKS:
                    kind = "experts"
                elif user.target is _EMBEDDING and argument == 0:
                    kind = "embedding"
                else:
                    kind = str(user.target)
                yield name, _Use(program, user, argument, kind)


def _int8_activations(weight: StoredWeight) -> bool:
    return weight.spec.activations == quant.INT8_ACTIVATIONS


def _reason_of_use(use: _Use, weight: StoredWeight) -> str | None:
    """Why this use cannot read the packed weight, or None."""
    dims = len(weight.spec.shape)
    if _int8_activations(weight) and use.kind not in ("linear", "embedding"):
        return f"recorded with int8 activations but read by {use.kind} (only linears have that kernel)"
    if use.kind == "linear":
        return None if dims == 2 else f"a linear reads a {dims}-D weight"
    if use.kind == "experts":
        return None if dims == 3 else f"an expert call reads a {dims}-D stack"
    if use.kind == "embedding":
        return None if dims == 2 else f"an embedding reads a {dims}-D table"
    return f"read by {use.kind}, not only as a linear's weight"


def prepare(
    programs: list[Program],
    weights: dict[str, Tensor],
    stored: dict[str, StoredWeight],
    device: str,
    upcast: bool,
    level: str,
    observed: tuple[Program, ...] = (),
) -> tuple[dict[str, Tensor], QuantizedLoad | None]:
    """The weights dict to call the programs with (every name, sorted) and what became of the
    quantized ones; rewrites the programs' uses of natively run weights in place.

    weights: the core's other weights (Core.load_stored); stored: its quantized ones. observed:
    programs that take the same weights dict but are not rewritten (a vision program): a quantized
    weight they read is dequantized. upcast: dequantize to float32 (a 16-bit core run upcast)."""
    if not stored:
        return weights, None
    names = sorted({*weights, *stored})
    reasons: dict[str, str] = {}
    if device != "cpu":
        reasons = {name: f"the engine runs on {device} (the quantized kernels are CPU ones)" for name in stored}
    elif not has_qlinear():
        reasons = {name: "no native quantized kernel here (flare_native::has_qlinear)" for name in stored}
    uses: dict[str, list[_Use]] = {name: [] for name in stored}
    collected = not reasons  # uses are looked up where native kernels could run
    if collected:
        for name, use in _uses(programs, names, set(stored)):
            uses[name].append(use)
        for name, _ in _uses(list(observed), names, set(stored)):
            reasons.setdefault(name, "read by a program helios does not rewrite (the vision tower's)")
        for name, found in uses.items():
            for use in found:
                why = _reason_of_use(use, stored[name])
                if why is not None:
                    reasons.setdefault(name, why)
        _pair_experts(uses, stored, reasons)
    native = [name for name in stored if name not in reasons]
    dtype = torch.float32 if upcast else None
    packed = {name: _pack(stored[name]) for name in native}
    dequantized = {name: stored[name].dequantize(dtype) for name in reasons}
    for name in native:
        compute = dtype or getattr(torch, stored[name].spec.dtype)  # the programs' activations
        for use in uses[name]:
            _rewrite(use, stored[name], compute)
    rounded = [name for name in reasons if _int8_activations(stored[name])]
    if rounded and not collected:
        for name, use in _uses(programs, names, set(rounded)):
            uses[name].append(use)
    for name in rounded:
        for use in uses[name]:
            _round_input(use)
    for program in {id(u.program): u.program for name in [*native, *rounded] for u in uses[name]}.values():
        program.module.graph.lint()
        program.module.recompile()
    held = str(dtype or getattr(torch, next(iter(stored.values())).spec.dtype)).removeprefix("torch.")
    outcome = QuantizedLoad(level, tuple(native), tuple(sorted(reasons)), held, tuple(sorted(set(reasons.values()))))
    _log(outcome, reasons)
    everything = {**weights, **packed, **dequantized}
    return {name: everything[name] for name in names}, outcome


def _pair_experts(uses: dict[str, list[_Use]], stored: dict[str, StoredWeight], reasons: dict[str, str]) -> None:
    """An expert call runs on the quantized kernel only when both its stacks do: a stack whose
    partner is dequantized (or not quantized at all) is dequantized too, until nothing changes."""
    stack_of = {(id(u.node), u.argument): name for name, found in uses.items() for u in found if u.kind == "experts"}
    changed = True
    while changed:
        changed = False
        for name, found in uses.items():
            for use in (u for u in found if u.kind == "experts" and name not in reasons):
                partner = stack_of.get((id(use.node), 7 - use.argument))  # 3 <-> 4
                if partner is None or partner in reasons:
                    reasons[name] = "its expert call's other stack does not run on the quantized kernel"
                    changed = True


def _pack(weight: StoredWeight) -> Tensor:
    act_bits = (8,) if _int8_activations(weight) else ()  # (the float-activation layout is the default)
    scales, mins = _narrowed(weight.scales, weight.mins)
    return torch.ops.flare_native.pack_qlinear(weight.qweight, scales, mins, weight.spec.group, *act_bits)


def _narrowed(scales: Tensor, mins: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """float32 scales (and minimums) as float16 where every one of them is a float16 value (a GGUF's
    grid, kept at import, stores them so): the blob a kernel streams is smaller by a quarter (int4)
    and each value widens back to the same float32, so the results keep their bits."""
    parts = [scales] if mins is None else [scales, mins]
    if scales.dtype != torch.float32 or not all(torch.equal(p.half().float(), p) for p in parts):
        return scales, mins
    return scales.half(), None if mins is None else mins.half()


@dataclass(frozen=True, slots=True)
class _Header:
    """A packed blob's header (native/linear_q.h: QHeader)."""

    magic: int
    bits: int
    group: int
    width: int  # input features
    out: int
    blocks: int
    scale_dtype: torch.dtype
    block_bytes: int

    @property
    def scale_bytes(self) -> int:
        return self.scale_dtype.itemsize


def _header(packed: Tensor) -> _Header:
    magic, bits, group, width, out, blocks, scales, block_bytes = packed[: _HEADER_WORDS * 8].view(torch.int64).tolist()
    kind, size = scales >> 32, scales & 0xFFFFFFFF  # int32 scale_bytes, then int32 scale_type
    dtype = torch.bfloat16 if kind == 0 and size == 2 else _SCALE_TYPES[kind]  # 0 with 2 bytes: an earlier build's
    return _Header(magic, bits, group, width, out, blocks, dtype, block_bytes)


def _round_input(use: _Use) -> None:
    """A dequantized weight recorded with int8 activations: its linear's input rounded as the
    int8-activation kernel rounds it (the values the core's self-check measured)."""
    node = use.node
    if use.kind != "linear":
        return
    graph = node.graph
    with graph.inserting_before(node):
        rounded = graph.call_function(quantized_ref.fake_quantize, (node.args[0],))
    node.args = (rounded, *node.args[1:])


def _rewrite(use: _Use, weight: StoredWeight, compute: torch.dtype) -> None:
    """Point one use at the packed weight (the placeholder now carries it)."""
    node = use.node
    out_features = int(weight.spec.shape[-2])
    if use.kind == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        node.target = torch.ops.flare_native.qlinear.default
        node.args, node.kwargs = (node.args[0], node.args[1], bias, out_features), {}
        return
    if use.kind == "embedding":  # a tied table: the head's linear and the lookup read one blob
        node.target = embedding_rows
        node.args, node.kwargs = (node.args[0], node.args[1], compute), {}
        return
    # An expert call (its partner stack is rewritten too): same arguments, plus what the packed
    # stacks no longer say, keyed by the argument this stack is.
    node.target = moe.routed_experts_quantized
    node.kwargs = {**node.kwargs, _STACKS[use.argument]: out_features, "dtype": compute}


def embedding_rows(packed: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows `ids` of a packed 2-D weight (flare_native::pack_qlinear's blob), dequantized
    exactly as helios.core.quant.dequantize and rounded to `dtype`: an embedding lookup of a table
    whose linear (the tied head) runs on the blob, so no float copy of the table is kept. Reads a
    block of 16 rows per id from the layout of native/linear_q.h (linear_qa.h's: flare_native::qembedding_a8)."""
    h = _header(packed)
    if h.magic in _MAGICS_A8:  # only the native library writes these, and reads them (_a8_rows: in torch ops)
        return torch.ops.flare_native.qembedding_a8(packed, ids, dtype, h.width)
    bits, group, width, blocks, block_bytes = h.bits, h.group, h.width, h.blocks, h.block_bytes
    scale_bytes, scale_dtype = h.scale_bytes, h.scale_dtype
    groups, int4 = width // group, bits == 4
    head = _BLOCK * scale_bytes * (2 if int4 else 1)  # a group's scales (and minimums)
    body = blocks * block_bytes
    flat = ids.reshape(-1)
    picked = packed[64 : 64 + body].view(blocks, groups, block_bytes // groups)[flat // _BLOCK]  # [T, G, per group]
    lane = (flat % _BLOCK).view(-1, 1, 1)

    def per_output(part: Tensor, dtype: torch.dtype | None = None) -> Tensor:  # [T, G, n * 16] -> [T, G, n] at lane
        part = part.contiguous().view(dtype) if dtype is not None else part
        rows = part.reshape(part.shape[0], groups, -1, _BLOCK)
        return rows.gather(3, lane[..., None].expand(-1, groups, rows.shape[2], 1)).squeeze(3)

    scales = per_output(picked[..., : _BLOCK * scale_bytes], scale_dtype).squeeze(2)
    mins = per_output(picked[..., _BLOCK * scale_bytes : head], scale_dtype).squeeze(2) if int4 else None
    q = per_output(picked[..., head:])  # [T, G, group or group / 2] bytes
    qweight = q.view(torch.int8) if not int4 else q
    rows = quant.dequantize(qweight.reshape(len(flat), -1), scales, mins, group, dtype)
    return rows.reshape(*ids.shape, width)


@dataclass(frozen=True, slots=True)
class _A8Geom:
    """Where an int8-activation blob's block holds what (native/linear_qa.h: A8Geom): its groups
    in chunks of `per_chunk`, each chunk `stride` bytes, `head` of them scales (a group's 16 at
    16 x scale bytes apart, int4's minimums `mins` bytes after its scales), then the chunk's weights,
    `kb_bytes` per 32 features."""

    per_chunk: int
    head: int
    stride: int
    mins: int
    kb_bytes: int


def _a8_geom(h: _Header) -> _A8Geom:
    groups, per_group = h.width // h.group, h.group // _ACT_BLOCK
    line = _BLOCK * h.scale_bytes * (2 if h.bits == 4 else 1)  # one group's scales (and minimums)
    kb_bytes = 256 if h.bits == 4 else 512
    per_chunk = groups if h.magic == _MAGIC_A8_REGION else max(1, 64 // line)
    head = -(-per_chunk * line // 64) * 64
    return _A8Geom(
        per_chunk, head, head + per_chunk * per_group * kb_bytes, per_chunk * _BLOCK * h.scale_bytes, kb_bytes
    )


def _a8_rows(packed: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows of an int8-activation blob (native/linear_qa.h, either layout) in torch ops: its
    layout spelled out, against which the tests hold flare_native::qembedding_a8, the reader
    embedding_rows runs. Row r lies in block r // 16, lane r % 16: group g's scale at the lane of its
    16, and per 32 features 64-byte steps of 16 rows x 4 bytes (int8 + 128; int4: features f and
    f + 16 in the low and high nibble)."""
    h = _header(packed)
    geo = _a8_geom(h)
    groups, per_group, sb, int4 = h.width // h.group, h.group // _ACT_BLOCK, h.scale_bytes, h.bits == 4
    flat = ids.reshape(-1)
    lane = flat % _BLOCK
    start = 64 + (flat // _BLOCK) * h.block_bytes  # [T] each row's block
    g = torch.arange(groups)
    scale_at = (g // geo.per_chunk) * geo.stride + (g % geo.per_chunk) * _BLOCK * sb  # [G]

    def scales(offset: Tensor) -> Tensor:  # [T, G] of the blob's scale type
        first = start[:, None] + offset[None, :] + lane[:, None] * sb
        return packed[first[..., None] + torch.arange(sb)].contiguous().view(h.scale_dtype).squeeze(-1)

    kb = torch.arange(h.width // _ACT_BLOCK)
    chunk = kb // per_group // geo.per_chunk
    weights_at = chunk * geo.stride + geo.head + (kb - chunk * geo.per_chunk * per_group) * geo.kb_bytes  # [KB]
    steps = torch.arange(geo.kb_bytes // 64) * 64
    at = start[:, None, None] + weights_at[None, :, None] + steps + lane[:, None, None] * 4  # [T, KB, steps]
    mine = packed[at[..., None] + torch.arange(4)]  # [T, KB, steps, 4]
    if int4:  # [T, KB, 4 steps, 4]: low nibbles features 0..15 of the block, high ones 16..31
        values = torch.cat(((mine & 15).flatten(2), (mine >> 4).flatten(2)), dim=2)
        stored = quant.pack_int4(values.reshape(len(flat), h.width))
        rows = quant.dequantize(stored, scales(scale_at), scales(scale_at + geo.mins), h.group, dtype)
    else:
        stored = (mine.flatten(1) ^ 0x80).view(torch.int8)
        rows = quant.dequantize(stored, scales(scale_at), None, h.group, dtype)
    return rows.reshape(*ids.shape, h.width)


def _log(outcome: QuantizedLoad, reasons: dict[str, str]) -> None:
    if outcome.native:
        log.info(
            "quantized weights (%s): %d tensor(s) run on helios' native quantized kernels",
            outcome.level,
            len(outcome.native),
        )
    for reason in outcome.reasons:
        count = sum(1 for why in reasons.values() if why == reason)
        log.info(
            "quantized weights (%s): %d tensor(s) dequantized to %s at load: %s",
            outcome.level,
            count,
            outcome.dtype,
            reason,
        )
