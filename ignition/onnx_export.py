"""`ignition export --onnx`: ONNX renditions of a core's programs, for ONNX Runtime.

Each program is converted from the torch.export program the core already holds (the saved
`.pt2`, so the ONNX graph is the same traced step, not a second trace of the model): the
flare:: ops become standard ONNX ops through plain-torch forms that trace to them
(`ONNX_FORMS` below; the KV write is an index_copy -> ScatterND, paged attention a Gather
over the block table with a masked softmax, routed experts a dense mix over every expert),
the in-place KV writes become outputs (ONNX has no aliasing: `kv_cache.N` in,
`kv_cache.N.updated` out), and `torch.onnx.export(..., dynamo=True)` writes opset
`OPSET`. Every program the core has is rendered: step, scored prefill, vision and the
drafter's (`mtp_draft.N`). The weights stay where they are: the graph's initializers are external data
pointing into `onnx/weights.safetensors`, the core's weights file (a hard link where the
file system allows, else a copy), at each tensor's offset, so nothing is converted or
repacked. `onnx/onnx.json` lists the programs (helios.core.onnx_program reads it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import sympy
import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.export.graph_signature import OutputKind, OutputSpec

from helios.core import manifest as mf
from helios.core.onnx_program import (
    CACHE_INPUT,
    CACHE_OUTPUT,
    ONNX_DIR,
    ONNX_WEIGHTS,
    OPSET,
    RECORD,
    OnnxRecord,
    output_name,
)
from helios.core.ops.moe import expert_activation, post_expert_norm
from helios.core.program import SCORED_PREFILL, STEP, VISION
from ignition.errors import UsageError, VerifyError
from ignition.examples import example_caches, example_inputs

if TYPE_CHECKING:
    from helios.core.bundle import Core

# Program kinds rendered first (helios' executor runs them every step); every other program the
# core has (vision, the drafter's mtp_draft.N) follows in the manifest's order.
KINDS = (STEP, SCORED_PREFILL)


def rendered_kinds(specs: dict[str, mf.ProgramSpec]) -> list[str]:
    """Every program kind of the core, step programs first: none is left torch-only."""
    return [kind for kind in KINDS if kind in specs] + [kind for kind in specs if kind not in KINDS]


def onnx_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """flare::write_kv without its padding rows (the ONNX step requires slot_mapping >= 0: helios'
    CPU steps never pad), as an in-place index_put at (page, offset) on the 4-d cache: the exporter
    makes it one ScatterND straight from the cache input to its updated-cache output, no reshape
    between, so a runner that binds both to one buffer updates the pool in place."""
    page_tokens = k_cache.shape[1]
    index = (torch.div(slot_mapping, page_tokens, rounding_mode="floor"), slot_mapping % page_tokens)
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def onnx_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """flare::paged_attention for every query row at once: each row gathers its sequence's pages
    (Gather over the block table) into [T, M * page_tokens] keys, masks what its position may not
    see, and attends (fp32 scores, as the reference's soft-capped path). Memory is T x the
    longest table, so long prefill chunks cost more than the torch kernel's per-sequence loop."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    rows = torch.arange(tokens, device=q.device)
    seq = (query_start_loc[1:, None] <= rows[None, :]).sum(0)  # each row's sequence
    tables = block_tables[seq].long()  # [T, M]
    length = tables.shape[1] * k_cache.shape[1]
    keys = k_cache[tables].reshape(tokens, length, kv_heads, dim).float()
    values = v_cache[tables].reshape(tokens, length, kv_heads, dim).float()
    key_pos = torch.arange(length, device=q.device)[None, :]
    visible = (key_pos <= positions[:, None]) & (key_pos < seq_lens[seq].long()[:, None])
    if window > 0:
        visible = visible & (key_pos > positions[:, None] - window)
    grouped = q.reshape(tokens, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)) * scale  # [T, KVH, G, L]
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), values.permute(0, 2, 1, 3))  # [T, KVH, G, D]
    out = torch.where(visible.any(-1)[:, None, None, None], out, 0.0)  # rows that see nothing: 0, as the op
    return out.reshape(tokens, heads, dim).to(q.dtype)


def onnx_routed_experts(
    h: Tensor,
    expert_weights: Tensor,
    expert_ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    limit: float = 0.0,
    alpha: float = 1.0,
    post_norm_scale: Tensor | None = None,
    post_norm_eps: float = 1e-6,
) -> Tensor:
    """flare::routed_experts densely: every expert runs on every row (batched MatMul over the
    stacked weights) and a [T, E] routing matrix mixes them. Exact, but E / top_k times the
    expert arithmetic of the sparse kernel: fine for small expert counts, slow for large MoEs."""
    wdt = w_gate_up.dtype
    gate_up = torch.matmul(h.to(wdt)[None], w_gate_up.transpose(1, 2)).float()  # [E, T, 2F]
    act = expert_activation(gate_up, activation, limit, alpha)
    y = post_expert_norm(torch.matmul(act.to(wdt), w_down.transpose(1, 2)).float(), post_norm_scale, post_norm_eps)
    mix = torch.zeros(h.shape[0], w_gate_up.shape[0], dtype=torch.float32, device=h.device)
    mix = mix.scatter_add(1, expert_ids, expert_weights.float())  # [T, E]
    return (y * mix.t()[:, :, None]).sum(0)


def onnx_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """aten::scaled_dot_product_attention as MatMul, masked Softmax and MatMul: the exporter's own
    translation takes 4-d inputs only, and vision towers attend over [heads, patches, dim]."""
    if k.shape[-3] != q.shape[-3]:  # grouped keys (enable_gqa): each shared by heads / kv_heads queries
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.matmul(scores.softmax(-1), v)


# flare op name -> its ONNX-traceable form; an op missing here has no ONNX form yet and a program
# calling it is refused at export (docs/core-format.md lists them).
ONNX_FORMS: dict[str, Callable[..., object]] = {
    "write_kv": onnx_write_kv,
    "paged_attention": onnx_paged_attention,
    "routed_experts": onnx_routed_experts,
}


def flare_ops(exported: torch.export.ExportedProgram) -> list[str]:
    """The flare:: ops a program calls, in first-call order."""
    found: list[str] = []
    for node in exported.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target.namespace == "flare" and node.target._opname not in found:
                found.append(node.target._opname)
    return found


def check_convertible(exported: torch.export.ExportedProgram, kind: str) -> None:
    missing = [op for op in flare_ops(exported) if op not in ONNX_FORMS]
    if missing:
        raise UsageError(
            f"--onnx: the {kind} program calls flare::{missing[0]}, which has no ONNX form yet "
            f"(ONNX forms exist for {', '.join(sorted(ONNX_FORMS))}; docs/core-format.md); export without --onnx"
        )


def _functional(exported: torch.export.ExportedProgram) -> tuple[torch.export.ExportedProgram, list[int]]:
    """The program with every flare op in its ONNX form and the KV writes as extra outputs
    (user-input mutations first, as functionalization orders them), and the kv_cache positions
    those outputs update, in order."""
    graph = exported.graph_module.graph
    for node in list(graph.nodes):  # a mutating custom op is auto-functionalized before any decomposition
        if node.op == "call_function" and node.target is torch.ops.flare.write_kv.default:
            with graph.inserting_before(node):  # run_decompositions re-traces through the Python form
                graph.call_function(onnx_write_kv, node.args, node.kwargs)
            graph.erase_node(node)
    exported.graph_module.recompile()
    # A loaded program's shape environment keeps the derived dim (B+1) as an expression among its
    # symbols' ranges, which run_decompositions's re-trace rejects; the dim's own symbol remains.
    env = torch._export.utils._get_shape_env_from_gm(exported.graph_module)
    if env is not None:
        for key in [k for k in env.var_to_range if not isinstance(k, sympy.Symbol)]:
            del env.var_to_range[key]
    table = {getattr(torch.ops.flare, name).default: form for name, form in ONNX_FORMS.items() if name != "write_kv"}
    table[torch.ops.aten.scaled_dot_product_attention.default] = onnx_attention
    functional = exported.run_decompositions(table)
    signature = functional.graph_signature
    inputs = [s.arg.name for s in signature.input_specs]
    skip = len(_weight_names(exported))
    mutated = [
        inputs.index(o.target) - skip for o in signature.output_specs if o.kind == OutputKind.USER_INPUT_MUTATION
    ]
    signature.output_specs = [
        OutputSpec(kind=OutputKind.USER_OUTPUT, arg=o.arg, target=None)
        if o.kind == OutputKind.USER_INPUT_MUTATION
        else o
        for o in signature.output_specs
    ]
    out_spec = pytree.tree_flatten(tuple(range(len(signature.output_specs))))[1]
    functional._module_call_graph[0].signature.out_spec = out_spec  # type: ignore[union-attr]
    return functional, mutated


def _weight_names(exported: torch.export.ExportedProgram) -> list[str]:
    """The weights dict's keys in the order the program flattens them (its first argument)."""
    return list(exported.call_spec.in_spec.child(0).child(0).context)  # type: ignore[union-attr]


def _safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (byte offset in the file, byte length) of each tensor of a safetensors file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {
        name: (8 + length + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    }


def convert(
    kind: str, spec: mf.ProgramSpec, program_path: Path, kv: mf.KvLayout, weights_path: Path, out: Path
) -> list[int]:
    """Write the ONNX rendition of the program at `program_path` to `out`; returns the kv_cache
    positions it writes (its `kv_cache.N.updated` outputs, in order)."""
    import onnx_ir as ir

    exported = torch.export.load(str(program_path))
    check_convertible(exported, kind)
    if kv.state:  # its ops are refused above; a state tensor is no paged cache (no kv_cache.N name)
        raise UsageError(f"--onnx: the {kind} program keeps recurrent state, which ONNX renditions do not carry yet")
    num_caches = len(exported.call_spec.in_spec.child(0).child(1).children())  # type: ignore[union-attr]
    weights = _weight_names(exported)
    functional, mutated = _functional(exported)
    try:
        onnx_program = torch.onnx.export(functional, dynamo=True, opset_version=OPSET, verbose=False)
    except Exception as exc:  # the exporter raises its own error types for any op it cannot translate
        raise UsageError(
            f"--onnx: the {kind} program did not convert to ONNX: {_failed_op(exc)} has no ONNX translation "
            f"({str(exc).splitlines()[0][:200]}); export without --onnx"
        ) from exc
    model = onnx_program.model
    graph = model.graph
    values, outputs = list(graph.inputs), list(graph.outputs)
    if len(values) != len(weights) + num_caches + len(spec.inputs) or len(outputs) != len(mutated) + len(spec.outputs):
        raise UsageError(
            f"--onnx: the {kind} program's ONNX graph has {len(values)} inputs and {len(outputs)} outputs, not the "
            f"torch program's {len(weights)} weights + {num_caches} caches + {len(spec.inputs)} inputs and "
            f"{len(mutated)} updated caches + {len(spec.outputs)} outputs; export without --onnx"
        )
    offsets = _safetensors_offsets(weights_path)
    absent = [name for name in weights if name not in offsets]
    if absent:  # a quantized core stores packed parts under other names
        raise UsageError(f"--onnx: the weights file holds no plain tensor {absent[0]!r} (quantized?); drop --onnx")
    for name, value in zip(weights, values[: len(weights)]):
        start, length = offsets[name]
        value.const_value = ir.ExternalTensor(
            weights_path.name, start, length, value.dtype, shape=value.shape, name=name, base_dir=str(out.parent)
        )
        graph.inputs.remove(value)
        value.name = name
        graph.register_initializer(value)
    rest = values[len(weights) :]
    for index, value in enumerate(rest[:num_caches]):
        value.name = CACHE_INPUT.format(index)
    for value, tensor in zip(rest[num_caches:], spec.inputs, strict=True):
        value.name = tensor.name
    for value, index in zip(outputs, mutated):
        value.name = CACHE_OUTPUT.format(index)
    for value, tensor in zip(outputs[len(mutated) :], spec.outputs, strict=True):
        value.name = output_name(tensor.name, spec)
    for name in [name for name, value in graph.initializers.items() if not value.uses()]:
        del graph.initializers[name]  # weights another program uses (the vision tower's, for the step)
    proto = ir.serde.serialize_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(proto.SerializeToString())
    return mutated


def _failed_op(exc: BaseException) -> str:
    """The op the exporter could not translate, as its error names it."""
    found = re.search(r"target=([\w.:]+)", "".join(str(e) for e in (exc, exc.__cause__, exc.__context__)))
    return found.group(1) if found else "an op of the program"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(src, dst)


def write(
    enabled: bool,
    specs: dict[str, mf.ProgramSpec],
    staging: Path,
    kv: mf.KvLayout,
    progress: Callable[[str], None] | None = None,
) -> None:
    """export_core's hook: with --onnx, the ONNX renditions of every program of the core under
    staging/onnx (before core.json, so the files map lists and digests them)."""
    if not enabled:
        return
    try:
        import onnx_ir  # noqa: F401  (torch.onnx's dynamo exporter needs onnxscript, which brings it)
        import onnxscript  # noqa: F401
    except ImportError:
        raise UsageError("--onnx needs the onnx extra: pip install 'flare[onnx]'") from None
    folder = staging / ONNX_DIR
    folder.mkdir(parents=True, exist_ok=True)
    weights_path = folder / ONNX_WEIGHTS
    _link_or_copy(staging / "weights.safetensors", weights_path)
    programs: dict[str, dict[str, object]] = {}
    for kind in rendered_kinds(specs):
        if progress is not None:
            progress(f"converting the {kind} program to ONNX")
        file = folder / f"{kind}.onnx"
        mutated = convert(kind, specs[kind], staging / specs[kind].file, kv, weights_path, file)
        programs[kind] = {"file": str(file.relative_to(staging)), "updated_caches": mutated}
    record = OnnxRecord.build(programs)
    (folder / RECORD).write_text(json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def describe(core: Core) -> str:
    """`ignition inspect`'s line for a core's ONNX renditions ("" without any)."""
    from helios.core.onnx_program import OnnxRecord, OnnxUnavailable

    try:
        record = OnnxRecord.read(core.root, core.manifest.files)
    except OnnxUnavailable as exc:
        return f"\nonnx        unreadable: {exc}"
    if record is None:
        return ""
    files = ", ".join(
        f"{kind} ({p.file}, writes {len(p.updated_caches)} caches)" for kind, p in record.programs.items()
    )
    return f"\nonnx        opset {record.opset}: {files}; initializers in {ONNX_DIR}/{ONNX_WEIGHTS}"


FLOAT32_TOLERANCE = 1e-4  # max |Δ| of a float32 core's ONNX outputs against its torch program


def _compare(kind: str, what: str, name: str, torch_out: Tensor, onnx_out: Tensor, tolerance: float) -> float:
    """|Δ| of one output (ids: exact, except where the two picks tie within `tolerance`)."""
    if torch_out.shape != onnx_out.shape:
        raise VerifyError(
            f"ONNX {kind} program, {what}: output {name} has shape {tuple(onnx_out.shape)}, the torch program's "
            f"{tuple(torch_out.shape)}; re-export the core with --onnx"
        )
    if torch_out.is_floating_point():
        diff = float((torch_out.double() - onnx_out.double()).abs().max()) if torch_out.numel() else 0.0
        if diff > tolerance:
            raise VerifyError(
                f"ONNX {kind} program, {what}: output {name} differs from the torch program by {diff:.3g} "
                f"(tolerance {tolerance:g}); re-export the core with --onnx"
            )
        return diff
    # Top-k ids may differ at ties: top_ids are checked against torch's distribution (_check_ties),
    # prompt_top_ids through their logprobs (prompt_top_logprobs, compared above as floats).
    if not torch.equal(torch_out, onnx_out) and name not in ("top_ids", "prompt_top_ids"):
        raise VerifyError(f"ONNX {kind} program, {what}: output {name} differs from the torch program's")
    return 0.0


def _check_ties(kind: str, what: str, torch_outs: dict[str, Tensor], onnx_outs: dict[str, Tensor], tol: float) -> None:
    """top_ids may differ only where the two picks have the same logprob (within tol) in torch's distribution."""
    if "top_ids" not in torch_outs:
        return
    logprobs = torch_outs["logits"] - torch_outs["logsumexp"][:, None]
    picked = logprobs.gather(1, torch_outs["top_ids"])
    instead = logprobs.gather(1, onnx_outs["top_ids"])
    if picked.numel() and float((picked - instead).abs().max()) > tol:
        raise VerifyError(f"ONNX {kind} program, {what}: top_ids differ from the torch program's beyond ties")


def _vision_examples(core: Core) -> list[tuple[Tensor, Tensor]]:
    """A seeded 90 x 60 image prepared as helios prepares one for the vision program: its views'
    (pixel_values, pixel_positions)."""
    import numpy as np

    from helios.frontend.images import prepare_views

    assert core.manifest.vision is not None
    rgb = np.random.default_rng(0).integers(0, 256, size=(60, 90, 3), dtype=np.uint8)
    return prepare_views(rgb, core.manifest.vision)


def _program_examples(spec: mf.ProgramSpec, vocab: int, page_tokens: int) -> dict[str, Tensor]:
    """export's example inputs by name; an input only some programs take is seeded noise of its
    shape at 5 rows (the drafter's hidden_states, host table rows), a vision core's step gets
    export's two image rows (one used, one not)."""
    generator = torch.Generator().manual_seed(0)
    own = {
        t.name: torch.randn(
            *((2 if t.name == "image_features" else 5) if isinstance(d, str) else d for d in t.shape),
            generator=generator,
        )
        for t in spec.inputs
        if t.dtype.startswith("float")
    }
    own["image_rows"] = torch.tensor([1, -1])
    return dict(zip((t.name for t in spec.inputs), example_inputs(spec.inputs, vocab, page_tokens, own)))


def verify(core: Core) -> float:
    """`ignition verify --onnx`: every ONNX program against its torch program, on export's example
    inputs (every output, and the caches it writes), the step programs also on the golden prompts
    (chunked prefill logprobs), the vision program on a prepared image. Returns the max |Δ|;
    VerifyError names the first output beyond tolerance."""
    from helios.core.onnx_program import OnnxRecord, OnnxUnavailable, load_onnx
    from helios.core.program import run_prompt

    m = core.manifest
    try:
        record = OnnxRecord.read(core.root, m.files)
        if record is None or not record.programs:
            raise OnnxUnavailable(f"{core.root}: the core has no ONNX rendition; re-export it with --onnx")
        programs = {kind: load_onnx(core.root, m.files, kind, m.programs[kind]) for kind in record.programs}
    except OnnxUnavailable as exc:
        raise VerifyError(str(exc)) from None
    tolerance = FLOAT32_TOLERANCE if m.weights.dtype == "float32" else m.golden.tolerance
    weights = core.load_weights()
    page_tokens = m.limits.page_tokens
    worst = 0.0
    for kind, onnx_program in programs.items():
        reference = core.load_program(kind)
        if kind == VISION:
            for index, (pixels, positions) in enumerate(_vision_examples(core)):
                views = [
                    p(weights, [], pixel_values=pixels, pixel_positions=positions) for p in (reference, onnx_program)
                ]
                for name in reference.output_names:
                    worst = max(
                        worst, _compare(kind, f"image view {index}", name, *(v[name] for v in views), tolerance)
                    )
            continue
        inputs = _program_examples(reference.spec, m.tokenizer.vocab_size, page_tokens)
        torch_caches, onnx_caches = example_caches(m.kv, page_tokens), example_caches(m.kv, page_tokens)
        expected, got = reference(weights, torch_caches, **inputs), onnx_program(weights, onnx_caches, **inputs)
        for name in reference.output_names:
            worst = max(worst, _compare(kind, "example inputs", name, expected[name], got[name], tolerance))
        _check_ties(kind, "example inputs", expected, got, tolerance)
        for index, (a, b) in enumerate(zip(torch_caches, onnx_caches, strict=True)):
            worst = max(worst, _compare(kind, "example inputs", f"kv_cache[{index}]", a, b, tolerance))
        if kind not in KINDS:  # a drafter's program runs on the step's hidden states, not on prompts
            continue
        for index, prompt in enumerate(m.golden.prompts):
            runs = [
                run_prompt(
                    p, weights, m.kv, page_tokens, list(prompt), chunk=m.golden.prefill_chunk, explicit_ids=[0, 1]
                )
                for p in (reference, onnx_program)
            ]
            what = f"golden prompt {index}"
            worst = max(worst, _compare(kind, what, "logprobs", runs[0].logprobs, runs[1].logprobs, tolerance))
            _check_ties(kind, what, runs[0].outputs, runs[1].outputs, tolerance)
    return worst


__all__ = [
    "FLOAT32_TOLERANCE",
    "KINDS",
    "ONNX_FORMS",
    "check_convertible",
    "convert",
    "describe",
    "flare_ops",
    "rendered_kinds",
    "verify",
    "write",
]
