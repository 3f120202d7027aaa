"""ignition export: checkpoint + recipe -> a versioned core bundle.

Steps: read the source, map and fuse its weights, export the step programs with
torch.export (saved without weights), write weights/tokenizer/template, run the
self-check against an independent plain-torch forward, record golden values, and
write core.json with a sha256 for every file. The bundle is assembled in a staging
directory and moved into place only when everything passed.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

import ignition
from helios.core import host, quant
from helios.core import manifest as mf
from helios.core.bundle import core_digest, sha256_file
from helios.core.golden import golden_key
from helios.core.ops import catalog as ops
from helios.core.program import (
    SCORED_PREFILL,
    STEP,
    VISION,
    CompiledProgram,
    Program,
    program_signature,
    run_prompt,
    vision_signature,
)
from ignition import host_embeddings, onnx_export, parallel, quant_check, quantize
from ignition.checks import check_logprob_outputs, round_up
from ignition.compiled import calls_native_topk, compile_program, native_topk, portable_logprobs, quantized_step
from ignition.errors import SourceError, UsageError, VerifyError
from ignition.examples import cache_and_input_shapes, example_caches, example_inputs
from ignition.models import family
from ignition.models.family import Family, PromptImages
from ignition.models.moe import stack_experts
from ignition.models.naming import rename
from ignition.recipe import Recipe, without_ranges
from ignition.sources import Checkpoint

Progress = Callable[[str], None]  # called with each phase's name as it starts; the previous phase has ended
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GOLDEN_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Flare compiles checkpoints into serving cores; helios serves them.",
)
GOLDEN_TOKENS = 24  # per prompt
GOLDEN_CHUNK = 7  # odd on purpose: chunks straddle page boundaries
TOLERANCE = {
    "float32": 1e-3,
    "bfloat16": 1.0,
    "float16": 0.1,
}  # max |Δ logprob| vs fp32 on the stored weights; bf16: docs/export.md


def self_check_tolerance(dtype: str, kv_dtype: str | None) -> float:
    """The tolerance of the less precise of the weights and the KV cache: a float32 core with a
    bfloat16 cache rounds every key and value to bfloat16 (0.06-0.17 in logprob on SmolLM2 from
    the cache alone, docs/export.md), which float32's 1e-3 would refuse."""
    return max(TOLERANCE[dtype], TOLERANCE[kv_dtype or dtype])


@dataclass(frozen=True, slots=True)
class ExportOptions:
    out: Path
    force: bool = False
    prompt_logprobs: bool = False
    max_top_logprobs: int = mf.MAX_TOP_LOGPROBS
    logprob_ids: bool = True
    aliases: tuple[str, ...] = ()
    max_model_len: int | None = None
    dtype: str | None = None  # None: the checkpoint's own (Checkpoint.dtype)
    kv_dtype: str | None = None  # KV cache pages; None: the weight dtype
    page_tokens: int = 16
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    ranges: bool = True
    model_id: str | None = None
    compile_step: bool = False  # also build the step ahead of time for this host (AOTInductor)
    tensor_parallel: tuple[int, ...] = (1,)  # declared tensor-parallel sizes (ignition.parallel)
    expert_parallel: bool = False  # MoE rank programs split the experts across the ranks
    host_embeddings: bool = (
        False  # the family's large embedding tables stay out of the programs (ignition.host_embeddings)
    )
    quantization: quantize.QuantRequest | None = None  # --quantize: weights stored at 8 or 4 bits
    onnx: bool = False  # --onnx: also the step programs' ONNX renditions (ignition.onnx_export)


@dataclass
class ExportResult:
    out: Path
    manifest: mf.Manifest
    seconds: float
    bytes: int
    max_abs_diff: float
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        m = self.manifest
        return {
            "core": str(self.out),
            "model_id": m.model.id,
            "recipe": m.recipe.name,
            "format_version": m.format.version,
            "digest": core_digest(m.files),
            "bytes": self.bytes,
            "seconds": round(self.seconds, 2),
            "max_abs_logprob_diff": self.max_abs_diff,
            "quantization": quant_check.describe(m.quantization) or None,
            "files": m.files,
        }


def check_options(options: ExportOptions) -> None:
    if not 0 <= options.max_top_logprobs <= mf.MAX_TOP_LOGPROBS:
        raise UsageError(
            f"--max-top-logprobs must be between 0 and {mf.MAX_TOP_LOGPROBS}, got {options.max_top_logprobs}"
        )
    if options.dtype is not None and options.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    if options.kv_dtype is not None and options.kv_dtype not in DTYPES:
        raise UsageError(f"--kv-dtype must be one of {', '.join(DTYPES)}, got {options.kv_dtype!r}")
    if options.page_tokens < 1 or options.page_tokens & (options.page_tokens - 1):
        raise UsageError(f"--page-tokens must be a positive power of two, got {options.page_tokens}")
    if not options.decode_buckets or any(b < 1 for b in options.decode_buckets):
        raise UsageError("--decode-buckets must be positive batch sizes, e.g. 1,2,4,8")
    if options.max_model_len is not None and options.max_model_len < 1:
        raise UsageError(f"--max-model-len must be positive, got {options.max_model_len}")
    quantize.check(options.quantization, options.tensor_parallel, options.host_embeddings)
    if options.out.exists() and not options.force:
        raise UsageError(f"{options.out} already exists; pass --force to replace it")


def internal_weights(
    fam: Family, checkpoint: Checkpoint, config: object, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Rename (declarative map), drop the tied head, stack experts (a family's optional
    stacked), fuse, and cast the checkpoint's tensors."""
    named: dict[str, torch.Tensor] = {}
    ignored = fam.ignored_tensor  # optional: tensors the family does not compile
    for hf_name, tensor in checkpoint.tensors.items():
        if ignored is not None and ignored(config, hf_name):
            continue
        mapped = rename(hf_name, fam.weight_map)
        if mapped is None:
            if "rotary_emb" in hf_name:
                continue
            raise SourceError(f"{checkpoint.reference}: unexpected tensor {hf_name!r} for the {fam.name} family")
        named[mapped[0]] = tensor
    if config.tie_word_embeddings:  # type: ignore[attr-defined]
        named.pop("lm_head", None)
    # Copies a checkpoint stores twice (DeepSeek-V3's MTP layers repeat the embedding and head):
    # an exact copy is kept once, and the programs read the original where the copy is absent.
    for copy, original in (fam.duplicates(config) if fam.duplicates is not None else {}).items():
        if copy in named and original in named and torch.equal(named[copy], named[original]):
            del named[copy]
    # MoE families: per-expert tensors -> one [E, rows, cols] stack per layer (ignition.models.moe).
    stack_experts(fam.stacked, named, checkpoint.reference)
    for fused, parts in fam.fused.items():
        # Every layer any part names: main layers, and MTP layers numbered after them (DeepSeek-V3's).
        for layer in _layers_named(parts, named):
            names = [p.format(layer) for p in parts]
            missing = [n for n in names if n not in named]
            if len(missing) == len(names):
                continue  # a layer without this group (DeepSeek's dense layers have no shared expert)
            if missing:
                raise SourceError(f"{checkpoint.reference}: missing tensors {missing}")
            named[fused.format(layer)] = torch.cat([named.pop(n) for n in names], dim=0)
    # Integer tables (DeepSeek-V4's token -> expert ids) keep their dtype.
    return {name: (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in sorted(named.items())}


def _layers_named(patterns: tuple[str, ...], names: dict[str, torch.Tensor]) -> list[int]:
    """The layer numbers that fill the "{}" of any of `patterns` among `names`, ascending."""
    found: set[int] = set()
    for pattern in patterns:
        regex = re.compile(re.escape(pattern).replace(re.escape("{}"), r"(\d+)"))
        found.update(int(m.group(1)) for name in names if (m := regex.fullmatch(name)))
    return sorted(found)


def _dynamic_shapes(weights: dict[str, torch.Tensor], kv: mf.KvLayout, inputs: tuple[mf.TensorSpec, ...]) -> tuple:
    return ({name: None for name in weights}, *cache_and_input_shapes(kv, inputs))


def compile_step(
    spec: mf.ProgramSpec,
    staging: Path,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    vocab_size: int,
    prompts: tuple[tuple[int, ...], ...],
    golden: dict[str, torch.Tensor],
    tolerance: float,
    quantized: quantize.Quantized | None = None,
    level: str = "",
) -> mf.CompiledSpec:
    """Build the step with AOTInductor for this host and check it against the portable step's
    golden logprobs (a quantized core's: the portable step on the native quantized kernels, whose
    rewrite it is built from); the package lands next to the portable program.

    With int8 activations the two steps round their activations to int8 from float values that
    Inductor's fused kernels and eager torch compute apart in the last bit, and a rounding that goes
    the other way moves the logprobs by up to as much as rounding activations to int8 moves them at
    all: such a step may differ from the portable one by the tolerance plus that movement (the
    golden values against the same dequantized weights on float activations)."""
    program = Program.load(STEP, spec, staging / spec.file, check_guards=False)
    reference = [golden[golden_key(index)] for index in range(len(prompts))]
    rounding = None
    if quantized is not None:
        if any(t.activations == quant.INT8_ACTIVATIONS for t in quantized.tensors.values()):
            floats = portable_logprobs(program, quantized.program, kv, page_tokens, prompts, GOLDEN_CHUNK)
            rounding = max(float((g - f).abs().max()) for g, f in zip(reference, floats, strict=True))
        weights = quantized_step(program, weights, quantized, level)
        reference = portable_logprobs(program, weights, kv, page_tokens, prompts, GOLDEN_CHUNK)
    native_topk(program, vocab_size)  # the same logprobs: only the order among tied top entries is fixed
    path = staging / "programs" / f"{STEP}.{host.fingerprint().machine}.aoti.so"
    try:
        compile_program(
            program,
            weights,
            example_caches(kv, page_tokens),
            example_inputs(spec.inputs, vocab_size, page_tokens),
            cache_and_input_shapes(kv, spec.inputs),
            path,
        )
    except Exception as exc:  # Inductor raises assorted errors (no compiler, unsupported op, ...)
        raise UsageError(f"--compile-step failed: {type(exc).__name__}: {str(exc)[:500]}; export without it") from exc
    compiled = CompiledProgram.load(STEP, spec, path)
    allowed = tolerance + (rounding or 0.0)
    worst = 0.0
    for index, prompt in enumerate(prompts):
        run = run_prompt(compiled, {}, kv, page_tokens, list(prompt), chunk=GOLDEN_CHUNK, explicit_ids=[0, 1])
        diff = float((run.logprobs - reference[index]).abs().max())
        worst = max(worst, diff)
        if diff > allowed:
            beyond = "" if rounding is None else f" plus {rounding:.3g}, what int8 activations move at all"
            raise VerifyError(
                f"self-check failed: the compiled step differs from the portable step by {diff:.3g} in logprob on "
                f"golden prompt {index} (tolerance {tolerance:g}{beyond}); export without --compile-step"
                + ("" if rounding is None else " or with --quant-activations float")
            )
    return mf.CompiledSpec(file=str(path.relative_to(staging)), host=host.fingerprint(), max_abs_diff=round_up(worst))


def vision_width(fam: Family, config: object) -> int:
    """The image feature width of a vision config (its language model's hidden size), 0 without one."""
    vision = fam.vision_of(config)
    return int(vision.text_hidden_size) if vision is not None else 0


def export_program(
    fam: Family,
    config: object,
    kind: str,
    num_top: int,
    explicit: bool,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    path: Path,
    tp: int = 1,
    host: host_embeddings.Tables = (),
) -> mf.ProgramSpec:
    """`tp` > 1: a rank program of that many ranks, traced with the sharded config (ignition.parallel).
    `host`: tables whose rows the program takes as its last input instead of as weights."""
    width = vision_width(fam, config)
    host_rows = host_embeddings.input_specs(host, weights)
    inputs, outputs = program_signature(
        kind,
        num_top,
        explicit,
        state=bool(kv.state),
        vision=width,
        window=kv.window_pool is not None,
        bidirectional=bool(width and fam.images_bidirectional(config)),
        host_rows=host_rows,
    )
    # A family may return more than the signature's outputs, after them (MiMo's hidden states for its drafter).
    if fam.extra_step_outputs is not None:
        outputs += fam.extra_step_outputs(config)
    module = fam.step_program(config, num_top, explicit, scored=kind == SCORED_PREFILL)
    module.tp = tp
    module.host_input = host_rows[0].name if host_rows else ""
    examples = host_embeddings.examples(host_rows) | (
        {
            "image_features": torch.randn(2, width, generator=torch.Generator().manual_seed(0)),
            "image_rows": torch.tensor([1, -1]),
        }
        if width
        else {}
    )
    weights = host_embeddings.program_weights(weights, host)
    return export_module(module, inputs, outputs, examples, config.vocab_size, weights, kv, page_tokens, path)  # type: ignore[attr-defined]


def export_vision(fam: Family, config: object, weights: dict[str, torch.Tensor], path: Path) -> mf.ProgramSpec:
    """The family's `vision` program (one image's patches -> feature rows), traced with a dynamic patch count."""
    assert fam.vision is not None
    vision = fam.vision_of(config)
    module = fam.vision.program(config)
    pixels, positions = fam.vision.examples(config)
    inputs, outputs = vision_signature(int(pixels.shape[1]), vision_width(fam, config))
    # At least two tokens' patches: a one-row output would specialize the graph (the profile's
    # resize rule never yields fewer on Gemma 4's patch budgets).
    patches = torch.export.Dim("X", min=2 * vision.pooling_kernel_size**2)
    shapes = ({name: None for name in weights}, [], {0: patches}, {0: patches})
    exported = torch.export.export(module, (weights, [], pixels, positions), dynamic_shapes=shapes)
    exported.example_inputs = None
    for node in exported.graph.nodes:
        node.meta.pop("stack_trace", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(exported, str(path))
    return mf.ProgramSpec(file=str(path.relative_to(path.parent.parent)), inputs=inputs, outputs=outputs)


def self_check_vision(
    fam: Family,
    config: object,
    checkpoint: Checkpoint,
    programs: dict[str, Program],
    vision: Program,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    prompts: tuple[tuple[int, ...], ...],
    tolerance: float,
    profile: mf.VisionProfile,
) -> float:
    """The saved vision program against the family's reference tower on a seeded view (features),
    then every step program with those features spliced into a golden prompt (framed by the
    profile's prefix/suffix tokens), prefilled in chunks that cut through the image, against the
    reference forward (logprobs). Returns the max |Δ|."""
    assert fam.vision is not None and fam.reference.features is not None
    stored = stored_tensors(checkpoint, weights)
    pixels, positions = fam.vision.examples(config)
    got = vision(weights, [], pixel_values=pixels, pixel_positions=positions)["image_features"]
    expected = fam.reference.features(config, stored, pixels, positions)
    worst = float((got - expected).abs().max())
    if worst > tolerance:
        raise VerifyError(
            f"self-check failed: the exported vision program differs from the reference vision tower by "
            f"{worst:.3g} in its features (tolerance {tolerance:g})"
        )
    head = list(prompts[0][:5]) + list(profile.prefix_token_ids)
    prompt = head + [profile.image_token_id] * int(got.shape[0]) + list(profile.suffix_token_ids) + list(prompts[0][5:])
    image_positions = list(range(len(head), len(head) + int(got.shape[0])))
    reference = torch.log_softmax(
        fam.reference.logits(config, stored, prompt, PromptImages(expected, tuple(image_positions))).float(), dim=-1
    )
    for kind, program in programs.items():
        run = run_prompt(
            program,
            weights,
            kv,
            page_tokens,
            prompt,
            chunk=GOLDEN_CHUNK,
            explicit_ids=[0, 1],
            image_features=got,
            image_positions=image_positions,
        )
        diff = float((run.logprobs - reference).abs().max())
        if diff > tolerance:
            raise VerifyError(
                f"self-check failed: the exported {kind} program with image features differs from the "
                f"reference forward by {diff:.3g} in logprob (tolerance {tolerance:g})"
            )
        worst = max(worst, diff)
    return worst


def export_module(
    module: torch.nn.Module,
    inputs: tuple[mf.TensorSpec, ...],
    outputs: tuple[mf.TensorSpec, ...],
    examples: dict[str, torch.Tensor],
    vocab_size: int,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    path: Path,
) -> mf.ProgramSpec:
    """Trace module(weights, kv_cache, *inputs) with dynamic dims and save it without weights."""
    caches = example_caches(kv, page_tokens)
    args = (weights, caches, *example_inputs(inputs, vocab_size, page_tokens, examples))
    exported = torch.export.export(module, args, dynamic_shapes=_dynamic_shapes(weights, kv, inputs))
    exported.example_inputs = None  # otherwise the example weights are saved with the graph
    for node in exported.graph.nodes:  # source paths and line numbers would make the bytes machine-specific
        node.meta.pop("stack_trace", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(exported, str(path))
    return mf.ProgramSpec(file=str(path.relative_to(path.parent.parent)), inputs=inputs, outputs=outputs)


def golden_prompts(tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokenizer.encode(text, add_special_tokens=False).ids[:GOLDEN_TOKENS]) for text in GOLDEN_TEXTS)


def self_check(
    fam: Family,
    config: object,
    checkpoint: Checkpoint,
    programs: dict[str, Program],
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    prompts: tuple[tuple[int, ...], ...],
    tolerance: float,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Saved programs vs the plain-torch reference; returns (max |Δ|, golden tensors)."""
    worst = 0.0
    golden: dict[str, torch.Tensor] = {}
    # The reference runs in fp32 on the weights as the core stores them (rounded to its dtype):
    # the check measures the program's arithmetic, not the precision the user chose.
    stored = stored_tensors(checkpoint, weights)
    for index, prompt in enumerate(prompts):
        reference = torch.log_softmax(fam.reference.logits(config, stored, list(prompt)).float(), dim=-1)
        for kind, program in programs.items():
            run = run_prompt(program, weights, kv, page_tokens, list(prompt), chunk=GOLDEN_CHUNK, explicit_ids=[0, 1])
            diff = float((run.logprobs - reference).abs().max())
            worst = max(worst, diff)
            if diff > tolerance:
                raise VerifyError(
                    f"self-check failed: the exported {kind} program differs from the reference forward by "
                    f"{diff:.3g} in logprob on golden prompt {index} (tolerance {tolerance:g})"
                )
            check_logprob_outputs(kind, run.outputs, run.logprobs, prompt, tolerance)
            if kind == STEP:
                golden[golden_key(index)] = run.logprobs.contiguous()
    return worst, golden


def stored_tensors(checkpoint: Checkpoint, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors rounded to the core's dtype, for the fp32 references."""
    dtype = next(iter(weights.values())).dtype
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in checkpoint.tensors.items()}


def export_extra_programs(
    fam: Family,
    config: object,
    num_top: int,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    staging: Path,
    progress: Progress | None = None,
) -> dict[str, tuple[mf.ProgramSpec, object]]:
    """A family's own program kinds (its optional `extra_programs(config, num_top, weights)`, e.g. MiMo's
    "mtp_draft.N"): kind -> (spec, the family's description with its `check`)."""
    out: dict[str, tuple[mf.ProgramSpec, object]] = {}
    for extra in fam.extra_programs(config, num_top, weights) if fam.extra_programs is not None else ():
        if progress is not None:
            progress(f"exporting the {extra.kind} program")
        path = staging / "programs" / f"{extra.kind}.pt2"
        spec = export_module(
            extra.module, extra.inputs, extra.outputs, extra.examples, config.vocab_size, weights, kv, page_tokens, path
        )  # type: ignore[attr-defined]
        out[extra.kind] = (spec, extra)
    return out


def check_extra_programs(
    extras: dict[str, tuple[mf.ProgramSpec, object]],
    checkpoint: Checkpoint,
    weights: dict[str, torch.Tensor],
    kv: mf.KvLayout,
    page_tokens: int,
    staging: Path,
    tolerance: float,
) -> float:
    """Each saved extra program against its family's reference (its `check`); returns the max |Δ|."""
    worst = 0.0
    stored = stored_tensors(checkpoint, weights) if extras else {}
    for kind, (spec, extra) in extras.items():
        program = Program.load(kind, spec, staging / spec.file)  # check what was saved, not the module
        diff = extra.check(program, stored, weights, kv, page_tokens)  # type: ignore[attr-defined]
        if diff > tolerance:
            raise VerifyError(
                f"self-check failed: the exported {kind} program differs from the reference by {diff:.3g} "
                f"in logprob (tolerance {tolerance:g})"
            )
        worst = max(worst, diff)
    return worst


def _limits(options: ExportOptions, config: object) -> mf.Limits:
    native = int(config.max_position_embeddings)  # type: ignore[attr-defined]
    max_len = options.max_model_len or native
    if max_len > native:
        raise UsageError(f"--max-model-len {max_len} exceeds the checkpoint's context length {native}")
    return mf.Limits(max_model_len=max_len, page_tokens=options.page_tokens)


def _tokenizer_info(
    checkpoint: Checkpoint, tokenizer: Tokenizer, vocab_size: int, template: str | None
) -> mf.TokenizerInfo:
    facts = checkpoint.tokenizer_facts
    special = {t.content: i for i, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.special}
    if not facts.eos_token_ids:
        raise SourceError(f"{checkpoint.reference}: the checkpoint declares no end-of-sequence token")
    return mf.TokenizerInfo(
        file="tokenizer.json",
        vocab_size=vocab_size,
        bos_token_id=facts.bos_token_id,
        eos_token_ids=facts.eos_token_ids,
        pad_token_id=facts.pad_token_id,
        add_bos_token=facts.add_bos_token,
        special_tokens=special,
        chat_template="chat_template.jinja" if template is not None else None,
    )


def kv_layout(fam: Family, config: object, dtype: str) -> mf.KvLayout:
    """The caches of a family's config in `dtype`: paged K/V, its extra caches, recurrent state and window pool."""
    num_layers, num_kv_heads, head_dim = fam.kv_shape(config)
    kv = mf.KvLayout(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        shared_kv=fam.shared_kv,
        extra=tuple(mf.ExtraCache(*e) for e in (fam.extra_caches(config) if fam.extra_caches else ())),
        state=tuple(mf.StateCache(*e) for e in (fam.state_caches(config) if fam.state_caches else ())),
    )
    pooled = fam.window_pool(config) if fam.window_pool else None  # sliding layers' caches pooled apart
    return msgspec.structs.replace(kv, window_pool=mf.WindowPool(*pooled)) if pooled is not None else kv


def export_core(
    checkpoint: Checkpoint, recipe: Recipe, options: ExportOptions, progress: Progress | None = None
) -> ExportResult:
    """`progress` (the CLI's display) hears each phase as it starts; it never changes the result."""
    started = time.perf_counter()
    phase = progress or (lambda name: None)
    fam = family(recipe.info.family)
    if options.dtype is None:  # the checkpoint's own, unless the family's 16-bit program is not yet accurate
        own = checkpoint.dtype if fam.accurate_16bit else "float32"
        options = replace(options, dtype=own)
    assert options.dtype is not None
    if checkpoint.family != recipe.info.family:
        raise SourceError(
            f"{checkpoint.reference}: a {checkpoint.family} checkpoint, but recipe {recipe.name!r} is for the "
            f"{recipe.info.family} family"
        )
    try:
        config = fam.config_from_hf(checkpoint.hf_config)
    except (KeyError, ValueError) as exc:
        raise SourceError(f"{checkpoint.reference}: unsupported or incomplete config ({exc})") from exc
    limits = _limits(options, config)
    parallel.check(fam, config, options.tensor_parallel, options.expert_parallel)
    host = host_embeddings.planned(fam, config, options.host_embeddings, options.tensor_parallel, options.compile_step)
    if options.compile_step and fam.vision_of(config) is not None:
        raise UsageError("--compile-step does not build vision cores yet (the step's image inputs); export without it")
    phase(f"converting weights to {options.dtype}")
    if fam.canonical_tensors is not None:  # a family's second layout, rewritten
        try:
            checkpoint = replace(checkpoint, tensors=fam.canonical_tensors(config, checkpoint.tensors))
        except ValueError as exc:
            raise SourceError(f"{checkpoint.reference}: {exc}") from exc
    weights = internal_weights(fam, checkpoint, config, DTYPES[options.dtype])
    kv = kv_layout(fam, config, options.kv_dtype or options.dtype)
    template = checkpoint.chat_template if recipe.info.template_source == "checkpoint" else None
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_json)
    staging = Path(tempfile.mkdtemp(prefix=f".{options.out.name}.", dir=options.out.parent))
    try:
        programs: dict[str, Program] = {}
        specs: dict[str, mf.ProgramSpec] = {}
        kinds = [STEP] + ([SCORED_PREFILL] if options.prompt_logprobs else [])
        for kind in kinds:
            phase(f"exporting the {kind} program")
            spec = export_program(
                fam,
                config,
                kind,
                options.max_top_logprobs,
                options.logprob_ids,
                weights,
                kv,
                options.page_tokens,
                staging / "programs" / f"{kind}.pt2",
                host=host,
            )
            specs[kind] = spec
            programs[kind] = Program.load(kind, spec, staging / spec.file)  # check what was saved, not the module
        extras = export_extra_programs(
            fam, config, options.max_top_logprobs, weights, kv, options.page_tokens, staging, phase
        )
        vision_program = None
        if fam.vision_of(config) is not None:
            phase(f"exporting the {VISION} program")
            vision_weights = host_embeddings.program_weights(weights, host)
            specs[VISION] = export_vision(fam, config, vision_weights, staging / "programs" / f"{VISION}.pt2")
            vision_program = Program.load(VISION, specs[VISION], staging / specs[VISION].file)
        specs.update({kind: spec for kind, (spec, _) in extras.items()})
        if max(options.tensor_parallel) > 1:
            phase(f"exporting the rank programs and shards for --tensor-parallel {max(options.tensor_parallel)}")
        declared = parallel.export_ranks(
            fam,
            config,
            options.tensor_parallel,
            options.expert_parallel,
            kinds,
            weights,
            lambda c: kv_layout(fam, c, options.kv_dtype or options.dtype),  # type: ignore[arg-type]
            options.dtype,
            staging,
            lambda c, kind, w, kv_, path, tp: export_program(
                fam, c, kind, options.max_top_logprobs, options.logprob_ids, w, kv_, options.page_tokens, path, tp
            ),
        )
        quantized = quantize.prepare(
            options.quantization, fam, config, checkpoint, weights, specs, staging, internal_weights, phase
        )
        phase("writing weights and tokenizer")
        save_file(quantize.file_tensors(quantized, weights), str(staging / "weights.safetensors"))
        hosted = host_embeddings.entries(host, weights, staging / "weights.safetensors")
        programs = host_embeddings.fed(programs, hosted, weights)  # the checks gather their rows from the table
        vision_program = host_embeddings.fed({VISION: vision_program}, hosted, weights)[VISION]
        (staging / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        if template is not None:
            (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
        prompts = golden_prompts(tokenizer)
        tolerance = self_check_tolerance(options.dtype, options.kv_dtype)
        phase("self-check against the reference forward")
        worst, golden = self_check(
            fam, config, checkpoint, programs, weights, kv, options.page_tokens, prompts, tolerance
        )
        extra_worst = check_extra_programs(extras, checkpoint, weights, kv, options.page_tokens, staging, tolerance)
        profile = None
        if vision_program is not None and fam.vision is not None:
            try:
                profile = fam.vision.profile(
                    config, checkpoint.processor_config or {}, limits.max_model_len, tokenizer.token_to_id
                )
            except ValueError as exc:
                raise SourceError(f"{checkpoint.reference}: unsupported image processor config ({exc})") from exc
            phase("self-check of the vision path")
            extra_worst = max(
                extra_worst,
                self_check_vision(
                    fam,
                    config,
                    checkpoint,
                    programs,
                    vision_program,
                    weights,
                    kv,
                    options.page_tokens,
                    prompts,
                    tolerance,
                    profile,
                ),
            )
        golden, quantization = quant_check.measure(
            quantized, programs[STEP], weights, golden, kv, prompts, tokenizer, limits
        )
        save_file(golden, str(staging / "golden.safetensors"))
        onnx_export.write(options.onnx, specs, staging, kv, phase)  # before the files map: it digests them
        compiled = {}
        if options.compile_step:
            phase("compiling the step for this CPU (AOTInductor)")
            compiled[STEP] = compile_step(
                specs[STEP],
                staging,
                weights,
                kv,
                options.page_tokens,
                config.vocab_size,
                prompts,
                golden,
                tolerance,
                quantized,
                quantization.level if quantization is not None else "",
            )
        phase("writing core.json")
        files = {str(p.relative_to(staging)): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        recipe_info = recipe.info if options.ranges else without_ranges(recipe.info)
        manifest = mf.Manifest(
            format=mf.FormatTag(
                mf.FORMAT_NAME,
                quantize.format_version(quantization, STEP in compiled, calls_native_topk(staging, compiled.get(STEP))),
            ),
            model=mf.ModelInfo(
                id=options.model_id or checkpoint.checkpoint_id,
                aliases=options.aliases,
                family=fam.name,
                name=checkpoint.name,
                source=mf.SourceIdentity(
                    kind=checkpoint.kind,
                    reference=checkpoint.reference,
                    files=checkpoint.files,
                    format=checkpoint.source_format,
                ),
            ),
            recipe=recipe_info,
            tokenizer=_tokenizer_info(checkpoint, tokenizer, config.vocab_size, template),
            limits=limits,
            kv=kv,
            capabilities=mf.Capabilities(
                max_top_logprobs=options.max_top_logprobs,
                explicit_logprob_ids=options.logprob_ids,
                prompt_logprobs=options.prompt_logprobs,
                vision=profile is not None,
            ),
            decode_weight_bytes=fam.decode_weight_bytes(config, quantize.sized(quantized, weights)),
            weights=mf.WeightsInfo(
                file="weights.safetensors", dtype=options.dtype, num_parameters=sum(t.numel() for t in weights.values())
            ),
            ops=mf.OpSet(**ops.describe()),  # type: ignore[arg-type]
            programs=specs,
            decode_buckets=tuple(sorted(set(options.decode_buckets))),
            golden=mf.GoldenInfo(
                file="golden.safetensors",
                prompts=prompts,
                prefill_chunk=GOLDEN_CHUNK,
                tolerance=tolerance,
                max_abs_diff=round_up(worst),
            ),
            provenance=mf.Provenance(
                ignition_version=ignition.__version__,
                torch_version=str(torch.__version__),
                exported_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            ),
            files=files,
            compiled=compiled,
            vision=profile,
            parallel=declared,
            host_embeddings=hosted,
            quantization=quantization,
        )
        (staging / mf.MANIFEST_FILE).write_bytes(mf.encode(manifest))
        _install(staging, options.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in options.out.rglob("*") if p.is_file())
    return ExportResult(
        out=options.out,
        manifest=manifest,
        seconds=time.perf_counter() - started,
        bytes=size,
        max_abs_diff=max(worst, extra_worst),
    )


def _install(staging: Path, out: Path) -> None:
    os.chmod(staging, 0o755)
    for path in staging.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


__all__ = ["ExportOptions", "ExportResult", "Progress", "check_options", "export_core"]
