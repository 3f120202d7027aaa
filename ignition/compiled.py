"""The compiled step: a program built ahead of time with AOTInductor for the export host.

The portable program runs node by node from Python: about fifty graph nodes per layer, each
a separate dispatch. Compiled, the norms, rotary, casts and activations of a layer fuse into
a handful of C++ loops, the linears run on weights packed once at build time (they are
constants of the package), and nothing goes through Python except the flare:: attention ops.
The linears use the kernel helios would choose on this host (helios.engine.prepack.choose):
oneDNN, or for bfloat16 weights helios' native AVX512-BF16 kernel, which the package then
calls by name (helios loads it before the package, and serves the portable program where it
cannot). The package is machine code for this CPU's instruction set, so the manifest records
the host it was built on and helios falls back to the portable program elsewhere.

A quantized core's step is built from the program helios would run at load
(helios.engine.quantized.prepare, reused as is): its quantized linears call
`flare_native::qlinear` on blobs packed here (package constants of about the stored bytes, no
float copy), its expert stacks and embedding rows the flare_quant:: ops
(helios.engine.quantized_ops) on the same blobs. The self-check compares it with that portable
step, which runs the same kernels.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from helios.core import manifest as mf
from helios.core import quant
from helios.core.bundle import StoredWeight
from helios.core.program import Program, run_prompt
from helios.engine import native, prepack, quantized_ops
from helios.engine import quantized as quantized_load
from helios.engine.kernels import moe
from ignition.errors import UsageError
from ignition.quantize import Quantized


class _Frozen(torch.nn.Module):
    """The portable program with its weights as constants: what AOTInductor freezes and packs."""

    def __init__(self, program: Program, weights: dict[str, Tensor]) -> None:
        super().__init__()
        # Not a submodule: an unlifted exported module refuses train()/eval(), and it holds
        # no state of its own (its weights are the dict passed to it).
        object.__setattr__(self, "inner", program.module)
        self.names = tuple(weights)
        for index, name in enumerate(self.names):  # parameter names may not contain dots
            setattr(self, f"w{index}", torch.nn.Parameter(weights[name], requires_grad=False))

    def forward(self, kv_cache: list[Tensor], *inputs: Tensor) -> Any:
        weights = {name: getattr(self, f"w{index}") for index, name in enumerate(self.names)}
        return self.inner(weights, kv_cache, *inputs)


def compile_program(
    program: Program,
    weights: dict[str, Tensor],
    kv_cache: list[Tensor],
    inputs: list[Tensor],
    dynamic: tuple[Any, ...],
    path: Path,
) -> None:
    """Build `program` with AOTInductor for this host into the shared object `path`.

    The package AOTInductor writes is a zip that its loader extracts on every start (seconds
    for a model's worth of constants); the core keeps only the shared object in it, which
    helios loads in place.

    `kv_cache` and `inputs` are example values (shapes >= 2 where dynamic) and `dynamic`
    the portable program's dynamic shapes for the cache list and each input, in order.
    """
    native.load()
    kernel = prepack.choose([program], weights)
    if kernel in prepack.NATIVE_KERNELS:  # the package's linears call flare_native::linear(_tiles) on packed constants
        weights = prepack.prepack([program], weights, kernel)
    module = _Frozen(program, weights)
    with torch.no_grad():
        exported = torch.export.export(module, (kv_cache, *inputs), dynamic_shapes=(dynamic[0], tuple(dynamic[1:])))
        # freezing: weights become constants that oneDNN packs once; emulate_precision_casts:
        # fused loops round at every cast the program makes, as the portable program does,
        # so the compiled and portable programs agree on 16-bit cores too.
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            package = Path(scratch) / "package.pt2"
            torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(package),
                inductor_configs={"freezing": True, "emulate_precision_casts": True},
            )
            with zipfile.ZipFile(package) as archive:
                objects = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
                if len(objects) != 1:
                    raise RuntimeError(f"expected one shared object in the AOTInductor package, found {objects}")
                # The loader finds the custom ops' call descriptions in the .json beside the .so.
                stem = objects[0].removesuffix(".so")
                for member, target in ((stem + ".so", path), (stem + ".json", path.with_suffix(".json"))):
                    with archive.open(member) as source, target.open("wb") as out:
                        shutil.copyfileobj(source, out, 1 << 22)


def quantized_step(program: Program, weights: dict[str, Tensor], quantized: Quantized, level: str) -> dict[str, Tensor]:
    """Rewrite the step `program` in place as helios does at load (helios.engine.quantized.prepare)
    and return the weights dict to build it with: each quantized weight as its packed blob.
    Raises UsageError where a quantized weight would be dequantized (the package would hold a
    float copy of it) - no native quantized kernel here, or a use helios runs on floats."""
    native.load()
    stored = {
        name: StoredWeight(
            record,
            quantized.stored[name + quant.QWEIGHT],
            quantized.stored[name + quant.SCALES],
            quantized.stored.get(name + quant.MINS),
        )
        for name, record in quantized.tensors.items()
    }
    plain = {name: w for name, w in weights.items() if name not in stored}
    prepared, outcome = quantized_load.prepare([program], plain, stored, "cpu", False, level)
    if outcome is not None and outcome.dequantized:
        raise UsageError(
            f"--compile-step cannot build this quantized step: {len(outcome.dequantized)} quantized weight(s) "
            f"would be dequantized into the package ({'; '.join(outcome.reasons)}); export without --compile-step"
        )
    _as_ops(program, list(prepared), quantized)
    return prepared


def _as_ops(program: Program, names: list[str], quantized: Quantized) -> None:
    """Point the rewritten step's quantized expert calls and embedding lookups (Python functions
    in the portable step) at ops a compiled package can call: their flare_quant:: ops, and a lookup
    of an int8-activation table straight at flare_native::qembedding_a8 (which the flare_quant:: op
    would call from Python, under the GIL, at every step)."""
    placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
    records = {
        node: quantized.tensors[name]
        for node, name in zip(placeholders[: len(names)], names, strict=True)
        if name in quantized.tensors
    }
    experts = inspect.signature(moe.routed_experts_quantized)
    for node in program.module.graph.nodes:
        if node.target is moe.routed_experts_quantized:
            bound = experts.bind(*node.args, **node.kwargs)
            bound.apply_defaults()  # the op takes every argument, in the function's order
            node.target = quantized_ops.ROUTED_EXPERTS
            node.args, node.kwargs = tuple(bound.arguments.values()), {}
        elif node.target is quantized_load.embedding_rows:
            packed, ids, dtype = node.args
            record = records[packed]
            a8 = record.activations == quant.INT8_ACTIVATIONS
            node.target = torch.ops.flare_native.qembedding_a8.default if a8 else quantized_ops.EMBEDDING_ROWS
            node.args = (packed, ids, dtype, int(record.shape[-1]))
    program.module.graph.lint()
    program.module.recompile()


def native_topk(program: Program, vocab: int) -> None:
    """Point the step's vocabulary-wide torch.topk calls (its top-logprob outputs:
    ignition/models/heads.py) at flare_native::topk_rows (native/topk.cpp: one pass per row, about a
    tenth of torch's time on a 49,152-entry row), where the native library is loaded here: the same
    values, and among equal values the lower index first (torch leaves that order open). Other
    topk calls (an MoE router's) stay torch's. A step built so needs a helios whose native library
    has the op: the export reads that from the package's op descriptions (calls_native_topk)."""
    if not native.load():
        return
    changed = False
    for node in program.module.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.topk.default:
            continue
        schema = torch.ops.aten.topk.default._schema
        values = dict(zip((a.name for a in schema.arguments), node.args)) | node.kwargs
        rows = values["self"].meta.get("val") if isinstance(values["self"], torch.fx.Node) else None
        if rows is None or rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[-1] != vocab:
            continue
        if values.get("dim", -1) not in (-1, 1) or not values.get("largest", True) or not values.get("sorted", True):
            continue
        node.target = torch.ops.flare_native.topk_rows.default
        node.args, node.kwargs = (values["self"], values["k"]), {}
        changed = True
    if changed:
        program.module.graph.lint()
        program.module.recompile()


def calls_native_topk(staging: Path, spec: mf.CompiledSpec | None) -> bool:
    """Whether a compiled step (its op descriptions beside the shared object) calls topk_rows."""
    if spec is None:
        return False
    described = (staging / spec.file).with_suffix(".json")
    return described.is_file() and '"flare_native::topk_rows"' in described.read_text(encoding="utf-8")


def portable_logprobs(
    program: Program,
    weights: dict[str, Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    prompts: tuple[tuple[int, ...], ...],
    chunk: int,
) -> list[Tensor]:
    """The portable step's logprobs on each prompt (prefilled in chunks of `chunk`): the compiled
    step's reference where the golden values are not this step's (a quantized core's golden
    values are its dequantized weights' float run)."""
    with torch.no_grad():
        return [
            run_prompt(program, weights, kv, page_tokens, list(prompt), chunk=chunk, explicit_ids=[0, 1]).logprobs
            for prompt in prompts
        ]
