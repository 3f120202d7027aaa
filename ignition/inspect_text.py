"""Human-readable renderings of manifests and the recipe table."""

from __future__ import annotations

from helios.core import Core
from helios.core.manifest import RecipeInfo
from helios.core.sampling import DISTRIBUTION_PARAMS
from ignition.quant_check import describe as describe_quantization
from ignition.recipe import sampling_row

_SHORT = {
    "temperature": "temp",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "rep",
    "presence_penalty": "presence",
    "frequency_penalty": "frequency",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def recipe_table(recipes: list[RecipeInfo]) -> str:
    header = ["recipe", "family", *(_SHORT[p] for p in DISTRIBUTION_PARAMS), "reasoning", "tools", "effort"]
    rows = []
    for info in recipes:
        sampled = sampling_row(info)
        rows.append(
            [
                info.name,
                info.family,
                *(sampled[p] for p in DISTRIBUTION_PARAMS),
                info.reasoning_syntax or "-",
                info.tool_syntax or "-",
                "/".join(info.effort_levels) or "-",
            ]
        )
    return _table(header, rows) + "\n\nA value without [min, max] is fixed at its default; top_k disabled = -1."


def describe(core: Core) -> str:
    m = core.manifest
    caps = m.capabilities
    lines = [
        f"core        {core.root}  (format {m.format.name} v{m.format.version}, digest {core.digest[:16]})",
        f"model       {m.model.id}  aliases: {', '.join(m.model.aliases) or '-'}  public id: {m.public_id}",
        f"family      {m.model.family}  ({m.weights.num_parameters / 1e6:.1f}M parameters, {m.weights.dtype})",
        f"source      {m.model.source.kind} {m.model.source.reference}",
        f"recipe      {m.recipe.name}: {m.recipe.basis}",
        f"tokenizer   vocab {m.tokenizer.vocab_size}, bos {m.tokenizer.bos_token_id}, eos {list(m.tokenizer.eos_token_ids)},"
        f" {len(m.tokenizer.special_tokens)} special tokens, template {m.tokenizer.chat_template or 'none'}",
        f"limits      max_model_len {m.limits.max_model_len}, page_tokens {m.limits.page_tokens}",
        f"kv          {m.kv.num_layers} layers x {m.kv.num_kv_heads} kv heads x {m.kv.head_dim} ({m.kv.dtype})"
        + "".join(f", + {len(e.layers)} x {e.name} [{e.num_heads} x {e.head_dim}]" for e in m.kv.extra),
        f"logprobs    top {caps.max_top_logprobs}, explicit ids {'yes' if caps.explicit_logprob_ids else 'no'},"
        f" prompt logprobs {'yes' if caps.prompt_logprobs else 'no'}",
        f"precision   {describe_quantization(m.quantization) if m.quantization else f'{m.weights.dtype} weights'},"
        f" kv cache {m.kv.dtype}",
        f"decode      {m.decode_weight_bytes / 1e6:.1f} MB of weights read per token",
        f"programs    {', '.join(f'{k} ({v.file})' for k, v in m.programs.items())}",
        f"ops         {m.ops.namespace} v{m.ops.version}: {', '.join(m.ops.ops)}",
        f"golden      {len(m.golden.prompts)} prompts, tolerance {m.golden.tolerance:g},"
        f" export |Δ| vs reference {m.golden.max_abs_diff:.2g}",
        f"provenance  ignition {m.provenance.ignition_version}, torch {m.provenance.torch_version},"
        f" exported {m.provenance.exported_at}",
        "sampling:",
    ]
    for name, value in sampling_row(m.recipe).items():
        lines.append(f"  {name:<20} {value}")
    return "\n".join(lines)
