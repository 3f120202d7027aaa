"""The `ignition` command line: export, verify, inspect, recipes, testmodel."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from helios.core import Core, CoreError, CoreFormatError
from helios.core.golden import recheck
from ignition.errors import ExitCode, FormatError, IgnitionError, SourceError, UsageError, VerifyError

app = typer.Typer(
    name="ignition",
    help=(
        "Compile LLM checkpoints into Flare cores that `helios serve` loads.\n\n"
        "Exit codes: 0 ok, 1 internal error, 2 usage error, 3 source error, "
        "4 verification failure, 5 unsupported core format version."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(error: IgnitionError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"ok": False, "error": error.message, "exit_code": int(error.code)}))
    typer.secho(f"error: {error.message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(int(error.code))


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--decode-buckets must be comma-separated integers, got {text!r}") from None


@app.command()
def export(
    src: Annotated[
        str | None,
        typer.Argument(
            help="HF checkpoint dir, cached HF repo id (org/name), or .gguf file. Default: the recipe's source."
        ),
    ] = None,
    recipe: Annotated[
        str, typer.Option("--recipe", "-r", help="Recipe name (recipes/NAME.toml) or path to a .toml.")
    ] = ...,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the core to.")] = ...,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    prompt_logprobs: Annotated[
        bool, typer.Option("--prompt-logprobs", help="Also export the scored-prefill program (prompt logprobs, echo).")
    ] = False,
    max_top_logprobs: Annotated[
        int,
        typer.Option(
            "--max-top-logprobs", help="Natural alternatives per position, 0..20 (0: no generation logprobs)."
        ),
    ] = 20,
    no_logprob_ids: Annotated[
        bool, typer.Option("--no-logprob-ids", help="Do not accept caller-chosen token ids to score.")
    ] = False,
    alias: Annotated[
        list[str] | None, typer.Option("--alias", help="Extra model name (repeatable); the first is the public id.")
    ] = None,
    model_id: Annotated[
        str | None, typer.Option("--model-id", help="Checkpoint identifier to record (default: from the source).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", help="Context limit in tokens (default: the checkpoint's).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Weight dtype: float32, bfloat16, float16 (default: the checkpoint's own; bfloat16 for a quantized GGUF).",
        ),
    ] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-dtype", help="KV cache dtype (default: the weight dtype); bfloat16 halves attention's memory traffic."
        ),
    ] = None,
    page_tokens: Annotated[int, typer.Option("--page-tokens", help="Tokens per KV page (power of two).")] = 16,
    decode_buckets: Annotated[
        str, typer.Option("--decode-buckets", help="Decode batch sizes to capture as CUDA graphs.")
    ] = "1,2,4,8,16,32,64,128,256",
    no_ranges: Annotated[
        bool,
        typer.Option("--no-ranges", help="Drop the recipe's intervals: every sampling parameter fixed at its default."),
    ] = False,
    compile_step: Annotated[
        bool,
        typer.Option(
            "--compile-step",
            help="Also build the step ahead of time for this CPU (AOTInductor; needs a C++ compiler, minutes). helios runs it on hosts with the same CPU features and torch, the portable step elsewhere.",
        ),
    ] = False,
    tensor_parallel: Annotated[
        str,
        typer.Option(
            "--tensor-parallel",
            help="Tensor-parallel sizes the core can be served at (e.g. 1,2,4): rank programs and weight shards for each (docs/parallel.md).",
        ),
    ] = "1",
    expert_parallel: Annotated[
        bool,
        typer.Option(
            "--expert-parallel", help="MoE families: split the experts across the ranks instead of each expert's width."
        ),
    ] = False,
    host_embeddings: Annotated[
        bool,
        typer.Option(
            "--host-embeddings",
            help="Keep the family's large embedding tables (Gemma 4's per-layer inputs) out of the programs: helios serves their rows from RAM or disk through a device row cache (docs/export.md).",
        ),
    ] = False,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            help="Store the linear weights (attention, MLP, experts) as int8 (symmetric) or int4 (scale and min) in groups along their inputs; a quantized GGUF's Q8_0/Q4_0/Q4_1/Q4_K blocks are kept as they are (docs/export.md).",
        ),
    ] = None,
    quant_group: Annotated[
        int, typer.Option("--quant-group", help="--quantize: values per scale along the inputs (32, 64 or 128).")
    ] = 32,
    quant_scales: Annotated[
        str,
        typer.Option(
            "--quant-scales",
            help="--quantize: dtype of the scales and minimums (float32, bfloat16, or float16 as GGUF's Q8_0 keeps them).",
        ),
    ] = "float32",
    quantize_embeddings: Annotated[
        bool, typer.Option("--quantize-embeddings", help="--quantize: also the embedding table.")
    ] = False,
    quantize_head: Annotated[
        bool,
        typer.Option(
            "--quantize-head", help="--quantize: also the output head (a tied head needs --quantize-embeddings too)."
        ),
    ] = False,
    quant_activations: Annotated[
        str,
        typer.Option(
            "--quant-activations",
            help="--quantize: what the quantized linears multiply by: float (exact) or int8 (llama.cpp's Q8_0-style activations and integer dot products: faster on CPUs, recorded in the manifest and self-checked so).",
        ),
    ] = "float",
    onnx: Annotated[
        bool,
        typer.Option(
            "--onnx",
            help="Also write ONNX renditions of the step programs (onnx/, opset 18) for ONNX Runtime: `helios serve --runtime onnxruntime` (docs/core-format.md).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")] = False,
) -> None:
    """Export a checkpoint plus a recipe into a core bundle, self-checked against a reference forward."""
    from ignition.export import ExportOptions, check_options, export_core
    from ignition.parallel import parse_sizes
    from ignition.progress import export_phases
    from ignition.quant_check import describe
    from ignition.quantize import QuantRequest
    from ignition.recipe import load_recipe
    from ignition.sources import open_source, resolve_default_source

    try:
        if quantize is None and quant_activations != "float":
            raise UsageError("--quant-activations needs --quantize (int8 or int4)")
        options = ExportOptions(
            out=out,
            force=force,
            prompt_logprobs=prompt_logprobs,
            max_top_logprobs=max_top_logprobs,
            logprob_ids=not no_logprob_ids,
            aliases=tuple(alias or ()),
            max_model_len=max_model_len,
            dtype=dtype,
            kv_dtype=kv_dtype,
            page_tokens=page_tokens,
            decode_buckets=_buckets(decode_buckets),
            ranges=not no_ranges,
            model_id=model_id,
            compile_step=compile_step,
            tensor_parallel=parse_sizes(tensor_parallel),
            expert_parallel=expert_parallel,
            host_embeddings=host_embeddings,
            onnx=onnx,
            quantization=QuantRequest(
                quantize, quant_group, quant_scales, quantize_embeddings, quantize_head, quant_activations
            )
            if quantize is not None
            else None,
        )
        check_options(options)
        loaded = load_recipe(recipe)
        from ignition.models import family

        try:
            family(loaded.info.family)
        except KeyError as exc:
            raise SourceError(f"recipe {loaded.name!r}: {exc.args[0]}") from None
        checkpoint_id = model_id
        if src is None:
            if loaded.source is None:
                raise UsageError(f"recipe {loaded.name!r} declares no default source: pass SRC")
            src = str(resolve_default_source(loaded.source.path))
            checkpoint_id = checkpoint_id or loaded.source.checkpoint_id
        with export_phases(quiet=as_json) as phase:
            phase(f"reading {src}")
            checkpoint = open_source(src, checkpoint_id)
            out.parent.mkdir(parents=True, exist_ok=True)
            result = export_core(checkpoint, loaded, options, progress=phase)
    except IgnitionError as error:
        _fail(error, as_json)
        return
    if as_json:
        print(json.dumps({"ok": True, **result.summary()}, indent=2, sort_keys=True))
    else:
        typer.echo(
            f"wrote {out} ({result.bytes / 1e6:.1f} MB) in {result.seconds:.1f}s; "
            f"self-check max |Δ logprob| {result.max_abs_diff:.2e}"
        )
        if result.manifest.quantization is not None:
            typer.echo(f"quantized {describe(result.manifest.quantization)}")


def _open(core_dir: Path, verify_checksums: bool) -> Core:
    try:
        return Core.open(core_dir, verify_checksums=verify_checksums)
    except CoreFormatError as exc:
        raise FormatError(str(exc)) from None
    except CoreError as exc:
        raise VerifyError(str(exc)) from None


@app.command()
def verify(
    core: Annotated[Path, typer.Argument(help="Core directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable result.")] = False,
    onnx: Annotated[
        bool, typer.Option("--onnx", help="Also run the ONNX programs under onnxruntime against the torch programs.")
    ] = False,
) -> None:
    """Re-check every checksum and re-run the golden logprob check."""
    from ignition.quant_check import check_stored, recorded_step

    try:
        opened = _open(core, verify_checksums=True)
        check_stored(opened)  # a quantized core's stored tensors: names, shapes, dtypes, finite scales
        try:
            worst = recheck(opened, *recorded_step(opened))
            if onnx:
                from ignition.onnx_export import verify as verify_onnx

                worst = max(worst, verify_onnx(opened))
        except CoreError as exc:
            raise VerifyError(str(exc)) from None
    except IgnitionError as error:
        _fail(error, as_json)
        return
    if as_json:
        print(json.dumps({"ok": True, "core": str(core), "digest": opened.digest, "max_abs_logprob_diff": worst}))
    else:
        typer.echo(f"{core}: ok ({len(opened.manifest.files)} files, golden max |Δ logprob| {worst:.2e})")


@app.command()
def inspect(
    core: Annotated[Path, typer.Argument(help="Core directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Show a core's manifest."""
    from helios.core import manifest as mf

    try:
        opened = _open(core, verify_checksums=False)
    except IgnitionError as error:
        _fail(error, as_json)
        return
    if as_json:
        sys.stdout.write(mf.encode(opened.manifest).decode())
        return
    from ignition.inspect_text import describe
    from ignition.onnx_export import describe as describe_onnx

    typer.echo(describe(opened) + describe_onnx(opened))


@app.command()
def recipes(as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False) -> None:
    """List the recipes with their sampling defaults and declared intervals."""
    from ignition.inspect_text import recipe_table
    from ignition.recipe import load_recipe, recipe_names

    try:
        loaded = [load_recipe(name) for name in recipe_names()]
    except IgnitionError as error:
        _fail(error, as_json)
        return
    if as_json:
        import msgspec

        print(msgspec.json.encode([r.info for r in loaded], order="deterministic").decode())
        return
    typer.echo(recipe_table([r.info for r in loaded]))


@app.command()
def testmodel(
    family_name: Annotated[str, typer.Argument(metavar="FAMILY", help="Architecture family, e.g. llama.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the checkpoint.")] = ...,
    seed: Annotated[int, typer.Option("--seed", help="Random seed for the weights.")] = 0,
    chat: Annotated[
        str | None,
        typer.Option("--chat", help="Use another family's special tokens and chat template (e.g. qwen3)."),
    ] = None,
    vision: Annotated[
        bool, typer.Option("--vision", help="A multimodal checkpoint with a tiny vision tower and processor config.")
    ] = False,
    mtp_layers: Annotated[
        int | None,
        typer.Option(
            "--mtp-layers",
            help="num_nextn_predict_layers: multi-token-prediction layers in the family's checkpoint layout (kimi_k3, mimo_v2, qwen3_next).",
        ),
    ] = None,
) -> None:
    """Write a tiny random-weight HF checkpoint of FAMILY (for tests)."""
    from ignition.testmodel import write_testmodel

    overrides = None if mtp_layers is None else {"num_nextn_predict_layers": mtp_layers}
    try:
        write_testmodel(family_name, out, seed, chat, vision, overrides)
    except IgnitionError as error:
        _fail(error)
        return
    typer.echo(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """The console script; argv: the arguments (default: the process's)."""
    try:
        app(args=argv)
    except IgnitionError as error:  # raised outside a command body
        typer.secho(f"error: {error.message}", fg=typer.colors.RED, err=True)
        sys.exit(int(error.code))


__all__ = ["app", "main", "ExitCode"]
