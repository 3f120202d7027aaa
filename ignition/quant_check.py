"""The quantized export's self-check figures, and the stored-tensor checks of `ignition verify`.

The step program's own arithmetic is checked against the family's reference on the float
weights (ignition.export.self_check). Here the same program runs on the dequantized weights
(what helios computes with a quantized core) and is compared with its float run: top-1
agreement and |Δ logprob| over the full vocabulary on the golden (calibration) prompts, and
the perplexity of both on a fixed English text shipped with ignition (data/perplexity.txt),
truncated to the core's context. One prefill pass per prompt and weight set.

Weights recorded with int8 activations (export --quant-activations int8) are measured so: their
linears' inputs go through helios.engine.quantized_ref.fake_quantize (Q8_0's rounding per 32-feature
block) in a copy of the program, the value helios' integer kernels multiply by.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import Tensor

from helios.core import Core, quant
from helios.core import manifest as mf
from helios.core.golden import golden_key
from helios.core.host_rows import HostFed
from helios.core.program import Program, run_prompt
from helios.engine import quantized_ref
from ignition.errors import VerifyError
from ignition.quantize import Quantized, level_of

PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity.txt"
PERPLEXITY_TOKENS = 4096  # at most (the text holds about 3,000 SmolLM2 tokens)
PERPLEXITY_CHUNK = 256  # prefill chunk: [chunk, vocab] logits at a time


class _NextTokenLogprobs:
    """A program whose outputs are reduced, chunk by chunk, to each position's logprob of the text's
    next token (as a [rows, 1] "logits" with zero logsumexp), so run_prompt's prefill never holds
    the whole text's [tokens, vocab] logits."""

    def __init__(self, program: Program, token_ids: list[int]) -> None:
        self.program = program
        self.input_names = program.input_names
        self.ids = torch.tensor(token_ids + [0], dtype=torch.int64)

    def __call__(self, weights: dict[str, Tensor], kv_cache: list[Tensor], **inputs: Tensor) -> dict[str, Tensor]:
        out = self.program(weights, kv_cache, **inputs)
        following = self.ids[inputs["positions"] + 1]
        logprob = out["logits"].float().gather(1, following[:, None])[:, 0] - out["logsumexp"].float()
        return {"logits": logprob[:, None], "logsumexp": torch.zeros_like(logprob)}


def perplexity_tokens(tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    ids = tokenizer.encode(PERPLEXITY_TEXT.read_text(encoding="utf-8"), add_special_tokens=False).ids
    return ids[: min(PERPLEXITY_TOKENS, max_model_len)]


def perplexity(
    program: Program, weights: dict[str, Tensor], kv: mf.KvLayout, page_tokens: int, ids: list[int]
) -> float:
    """exp of the mean negative logprob of each next token of `ids` (one chunked prefill); 0 for a
    context too short to score a token (JSON has no NaN)."""
    if len(ids) < 2:
        return 0.0
    scorer = _NextTokenLogprobs(program, ids)
    run = run_prompt(scorer, weights, kv, page_tokens, ids, chunk=PERPLEXITY_CHUNK)  # type: ignore[arg-type]
    return math.exp(-float(run.logprobs[:-1, 0].double().mean()))


def with_int8_activations(program: Program, names: list[str], tensors: dict[str, mf.QuantizedTensor]) -> Program:
    """`program` (taking the weights dict in `names` order) with the input of every linear whose weight
    is recorded with int8 activations rounded as helios' int8-activation kernel rounds it; the
    program itself where none is."""
    wanted = {name for name, t in tensors.items() if t.activations == quant.INT8_ACTIVATIONS}
    if not wanted:
        return program
    with warnings.catch_warnings():  # (torch's pytree specs warn about their own deprecations when copied)
        warnings.simplefilter("ignore", FutureWarning)
        module = copy.deepcopy(program.module)
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders[: len(names)], names, strict=True):
        if name not in wanted:
            continue
        for user in list(node.users):
            if user.target is torch.ops.aten.linear.default and user.args[1] is node:
                with graph.inserting_before(user):
                    rounded = graph.call_function(quantized_ref.fake_quantize, (user.args[0],))
                user.args = (rounded, *user.args[1:])
    graph.lint()
    module.recompile()
    return Program(program.kind, program.spec, module)


def recorded_step(core: Core) -> tuple[Program | HostFed, dict[str, Tensor]]:
    """The step program and weights that reproduce a core's golden values: the saved step on the
    (dequantized) weights, its linears' inputs rounded to int8 where the core records int8
    activations (as measure recorded them)."""
    program, weights = core.load_program(), core.load_weights()
    quantization = core.manifest.quantization
    if quantization is not None and isinstance(program, Program):
        program = with_int8_activations(program, list(weights), quantization.tensors)
    return program, weights


def _figure(value: float) -> float:
    """Five significant digits: stable bytes across reruns of one export."""
    return float(f"{value:.5g}")


def measure(
    quantized: Quantized | None,
    program: Program,
    float_weights: dict[str, Tensor],
    golden: dict[str, Tensor],
    kv: mf.KvLayout,
    prompts: tuple[tuple[int, ...], ...],
    tokenizer: Tokenizer,
    limits: mf.Limits,
) -> tuple[dict[str, Tensor], mf.Quantization | None]:
    """(the golden logprobs the core records, its quantization record). `golden` holds the step's
    logprobs on the float weights; a quantized core's golden values are its run on the dequantized
    weights, compared with them for the figures."""
    if quantized is None:
        return golden, None
    from ignition.export import GOLDEN_CHUNK  # (export imports this module)

    page_tokens = limits.page_tokens
    quantized_program = with_int8_activations(program, list(quantized.program), quantized.tensors)
    recorded: dict[str, Tensor] = {}
    agree = positions = 0
    worst, total, count = 0.0, 0.0, 0
    for index, prompt in enumerate(prompts):
        run = run_prompt(quantized_program, quantized.program, kv, page_tokens, list(prompt), chunk=GOLDEN_CHUNK)
        key = golden_key(index)
        recorded[key] = run.logprobs.contiguous()
        delta = (run.logprobs - golden[key]).abs()
        agree += int((run.logprobs.argmax(-1) == golden[key].argmax(-1)).sum())
        positions += int(delta.shape[0])
        worst = max(worst, float(delta.max()))
        total += float(delta.double().sum())
        count += delta.numel()
    ids = perplexity_tokens(tokenizer, limits.max_model_len)
    check = mf.QuantSelfCheck(
        prompts=len(prompts),
        positions=positions,
        top1_agreement=_figure(agree / max(positions, 1)),
        max_abs_logprob_diff=_figure(worst),
        mean_abs_logprob_diff=_figure(total / max(count, 1)),
        perplexity=_figure(perplexity(quantized_program, quantized.program, kv, page_tokens, ids)),
        reference_perplexity=_figure(perplexity(program, float_weights, kv, page_tokens, ids)),
        perplexity_tokens=len(ids),
        requantized={name: _figure(error) for name, error in sorted(quantized.requantized.items())},
    )
    return recorded, mf.Quantization(level=level_of(quantized.tensors), tensors=quantized.tensors, self_check=check)


def describe(quantization: mf.Quantization | None) -> str:
    """One line for the export summary and `ignition inspect`."""
    if quantization is None:
        return ""
    origins = sorted({t.origin for t in quantization.tensors.values()})
    line = f"{quantization.level}: {len(quantization.tensors)} weights ({', '.join(origins)})"
    int8 = sum(t.activations == quant.INT8_ACTIVATIONS for t in quantization.tensors.values())
    if int8:
        line += f", {int8} on int8 activations"
    check = quantization.self_check
    if check is None:
        return line
    line += (
        f"; vs unquantized: top-1 agreement {check.top1_agreement:.1%} over {check.positions} positions,"
        f" |Δ logprob| max {check.max_abs_logprob_diff:.3g} mean {check.mean_abs_logprob_diff:.3g};"
        f" perplexity {check.perplexity:.4g} (unquantized {check.reference_perplexity:.4g},"
        f" {check.perplexity_tokens} tokens)"
    )
    if check.requantized:
        line += f"; requantized {len(check.requantized)} (max error {max(check.requantized.values()):.3g})"
    return line


# ---------------------------------------------------------------------------- verify


def expected_parts(name: str, record: mf.QuantizedTensor) -> dict[str, tuple[tuple[int, ...], str]]:
    """The stored tensors of one quantized weight: name -> (shape, dtype)."""
    *lead, rows, inputs = record.shape
    groups = (*lead, rows, inputs // record.group)
    parts = {
        name + quant.QWEIGHT: (
            (*lead, rows, inputs) if record.format == quant.INT8 else (*lead, rows, inputs // 2),
            "int8" if record.format == quant.INT8 else "uint8",
        ),
        name + quant.SCALES: (groups, record.scale_dtype),
    }
    if record.format == quant.INT4:
        parts[name + quant.MINS] = (groups, record.scale_dtype)
    return parts


def check_stored(core: Core) -> None:
    """Each quantized weight's stored tensors exist with the manifest's shapes and dtypes, its
    float name is not stored too, and its scales and minimums are finite; raises VerifyError
    naming the tensor."""
    quantization = core.manifest.quantization
    if quantization is None:
        return
    path = core.root / core.manifest.weights.file
    with safe_open(str(path), framework="pt") as handle:
        present = set(handle.keys())
        for name, record in sorted(quantization.tensors.items()):
            if (
                record.format not in quant.FORMATS
                or record.group not in quant.GROUPS
                or record.shape[-1] % record.group
            ):
                raise VerifyError(f"{path}: {name}: unsupported quantization {record.format} g{record.group}")
            if name in present:
                raise VerifyError(f"{path}: {name} is stored as floats and quantized; re-export the core")
            for part, (shape, dtype) in expected_parts(name, record).items():
                if part not in present:
                    raise VerifyError(f"{path}: {part} is missing (quantized weight {name}); re-export the core")
                tensor = handle.get_tensor(part)
                got = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
                if got != (shape, dtype):
                    raise VerifyError(
                        f"{path}: {part} is {got[1]} {list(got[0])}, the manifest says {dtype} {list(shape)}; "
                        "re-export the core"
                    )
                if part.endswith((quant.SCALES, quant.MINS)) and not bool(torch.isfinite(tensor).all()):
                    raise VerifyError(f"{path}: {part} holds non-finite values; re-export the core")


__all__ = ["check_stored", "describe", "expected_parts", "measure", "perplexity", "perplexity_tokens"]
