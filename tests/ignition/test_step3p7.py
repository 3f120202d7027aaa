"""The step5 family (StepFun Step 3.5/3.7 text): a tiny checkpoint in StepFun's own config
spellings (window 8 < 16-token pages, sliding layers with more query heads, partial rotary with
llama3 scaling on full layers, a dense layer then clamped sigmoid-routed MoE layers with a shared
expert, one MTP layer) exported with the step5 recipe and checked against transformers' own
Step3p7ForConditionalGeneration, through run_prompt and the engine; the recipe's template and
parsers end to end through Chat Completions, Messages and Responses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from helios.core import Core
from helios.core.program import run_prompt
from ignition.export import internal_weights
from ignition.models import family_of_hf_config, step3p7
from ignition.sources import open_source
from tests.ignition import family_checks
from tests.ignition.family_checks import LONG_TEXT, TEXTS, hf_logprobs

PAGE = 16
WINDOW = 8
# (tiny Step 3.7 checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("step5", "step5", "Step3p7ForConditionalGeneration")


def _prompts(core: Core) -> list[list[int]]:
    """A rendered chat (the published template), a long text and a short one."""
    return family_checks.chat_prompts(
        core, {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<|im_end|>"}, LONG_TEXT, TEXTS[2]
    )


def test_config_reads_the_step_layout(tiny: tuple[Path, Path]) -> None:
    hf = json.loads((tiny[0] / "config.json").read_text())
    assert family_of_hf_config(hf) == "step5"
    config = step3p7.FAMILY.config_from_hf(hf)
    assert config.layer_windows == (0, WINDOW, WINDOW, 0) and config.layer_heads == (4, 6, 6, 4)
    assert config.layer_sparse == (False, True, True, True) and config.num_mtp_layers == 1
    assert (config.rope_full.dim, config.rope_full.llama3, config.rope_sliding.dim) == (8, True, 16)
    assert config.routed_limits == (0.0, 0.0, 1.5, 0.0) and config.shared_limits == (1.5, 0.0, 0.0, 2.0)
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("step5", "step5", PAGE)
    assert (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (4, 2, 16)
    assert (m.recipe.reasoning_syntax, m.recipe.tool_syntax, m.recipe.template_source) == (
        "think",
        "qwen3_coder",
        "checkpoint",
    )


def test_transformers_spellings_read_the_same_config(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers writes the config in its own spellings (rope_parameters per layer type,
    per_layer_config, n_routed_experts, mlp_layer_types, MTP entries split off): same model."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(tiny[0])).save_pretrained(str(tmp_path))
    native = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in native["text_config"] and "moe_layers_enum" not in native["text_config"]
    ours = json.loads((tiny[0] / "config.json").read_text())
    assert step3p7.FAMILY.config_from_hf(native) == step3p7.FAMILY.config_from_hf(ours)
    flat = dict(ours["text_config"], architectures=["Step3p5ForCausalLM"])  # Step-3.5-Flash: text only, flat
    assert family_of_hf_config(flat) == "step5" and step3p7.FAMILY.config_from_hf(
        flat
    ) == step3p7.FAMILY.config_from_hf(ours)


def test_other_layouts_read_the_same_weights(tiny: tuple[Path, Path], reference) -> None:
    """transformers' in-memory names (model.language_model., fused mlp.experts.gate_up_proj) read
    the same weights; vision tower, projector and MTP-layer tensors are left out."""
    checkpoint = open_source(str(tiny[0]))
    config = step3p7.FAMILY.config_from_hf(checkpoint.hf_config)
    native = {n: t for n, t in reference.state_dict().items() if "rotary_emb" not in n}
    assert any(n.startswith("model.vision_model.") for n in native)
    assert any(n.startswith("model.layers.4.") for n in checkpoint.tensors)  # the MTP layer
    extra = {"vision_model.conv1.weight": torch.ones(2, 3), "vit_large_projector.weight": torch.ones(2, 2)}
    plain = internal_weights(
        step3p7.FAMILY, replace(checkpoint, tensors=checkpoint.tensors | extra), config, torch.float32
    )
    renamed = internal_weights(step3p7.FAMILY, replace(checkpoint, tensors=native), config, torch.float32)
    assert renamed.keys() == plain.keys() and all(torch.equal(renamed[n], plain[n]) for n in plain)
    assert not any(n.startswith("layers.4.") for n in plain)
    ids = list(range(3, 40))
    assert torch.equal(
        step3p7.reference_logits(config, native, ids), step3p7.reference_logits(config, checkpoint.tensors, ids)
    )


def _text(**changes: Any) -> Any:
    def change(hf: dict) -> dict:
        return hf | {"text_config": hf["text_config"] | changes}

    return change


REFUSED = {
    "bidirectional": _text(use_bidirectional_attention=True),
    "attention_bias": _text(attention_bias=True),
    "mlp_bias": _text(mlp_bias=True),
    "elementwise_gate": _text(gating="elementwise"),
    "no_head_gate": _text(use_head_wise_attn_gate=False),
    "softmax_router": _text(moe_router_activation="softmax"),
    "unnormalized_router": _text(norm_expert_weight=False),
    "yarn": _text(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}),
    "scaled_sliding_rope": _text(yarn_only_types=["full_attention", "sliding_attention"]),
    "sparse_layer_type": _text(
        layer_types=["full_attention", "minimax_m3_sparse", "sliding_attention", "full_attention", "full_attention"]
    ),
    "other_kv_heads": _text(attention_other_setting={"num_attention_heads": 6, "num_attention_groups": 1}),
    "per_layer_head_dim": _text(per_layer_config={"1": {"head_dim": 32}}),
    "odd_rotary": _text(partial_rotary_factors=[0.3125] * 5),
    "negative_limit": _text(swiglu_limits=[-1.0, 0, 0, 0, 0]),
    "quantized": lambda hf: hf | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
    "inner_tie_only": _text(tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_variants_are_refused(tiny: tuple[Path, Path], name: str) -> None:
    config = REFUSED[name](json.loads((tiny[0] / "config.json").read_text()))
    with pytest.raises(ValueError):
        step3p7.FAMILY.config_from_hf(config)


def test_reference_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """The self-check's float64 reference is transformers' model (so the export checks against it)."""
    assert family_checks.reference_error("step5", tiny[0], reference, list(range(5, 60))) <= 2e-4


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Prompts longer than the window and than a page, prefilled whole, in chunks of 16 and 5,
    and token by token past the first page (decode rows whose window has slid); and the first two's prompt logprobs."""
    prompts = _prompts(Core.open(tiny[1]))
    assert all(len(ids) > PAGE > WINDOW for ids in prompts[:2])
    family_checks.check_program_logprobs(tiny[1], reference, prompts, scored=prompts[:2])


@pytest.mark.parametrize("text", [LONG_TEXT, TEXTS[1], TEXTS[2]])
def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference, text: str) -> None:
    """The engine's greedy tokens (16-token prefill chunks, windowed decode rows) carry
    transformers' logprobs and top alternatives on the whole sequence."""
    family_checks.check_generation_matches(tiny[1], reference, text, 16)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """8 prompts together == each alone, prefix cache on and off, 16-token prefill chunks."""
    family_checks.check_eight_prompts_batching(tiny[1])


def test_plain_variant_matches_transformers(tmp_path: Path) -> None:
    """transformers' defaults where the tiny config is explicit: no layer_types (all full), no
    moe_layers_enum (layers 0-2 dense), one scalar rope_theta over whole heads, no clamps, a
    query_pre_attn_scalar of its own, and the head tied to the embedding (top-level flag)."""
    from ignition.export import ExportOptions, export_core
    from ignition.recipe import load_recipe
    from ignition.testmodel import _init, write_testmodel

    checkpoint = write_testmodel("step5", tmp_path / "ckpt", seed=5)
    config = json.loads((checkpoint / "config.json").read_text())
    dropped = (
        "moe_layers_enum",
        "layer_types",
        "attention_other_setting",
        "partial_rotary_factors",
        "rope_scaling",
        "yarn_only_types",
        "swiglu_limits",
        "swiglu_limits_shared",
    )
    text = {k: v for k, v in config["text_config"].items() if k not in dropped}
    config |= {"tie_word_embeddings": True, "text_config": text | {"rope_theta": 50_000.0, "query_pre_attn_scalar": 24}}
    (checkpoint / "config.json").write_text(json.dumps(config))
    parsed = step3p7.FAMILY.config_from_hf(config)
    assert parsed.layer_sparse == (False, False, False, True) and parsed.tie_word_embeddings
    generator = torch.Generator().manual_seed(5)
    tensors = {n: _init(n, s, generator) for n, s in step3p7.hf_shapes(parsed).items()}
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    model = family_checks.hf_model(checkpoint, "Step3p7ForConditionalGeneration")
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    ids = list(range(7, 47))
    expected = hf_logprobs(model, ids)
    ours = torch.log_softmax(step3p7.reference_logits(parsed, open_source(str(checkpoint)).tensors, ids), dim=-1)
    assert float((ours - expected).abs().max()) <= 2e-4
    result = export_core(open_source(str(checkpoint)), load_recipe("step5"), ExportOptions(out=tmp_path / "core"))
    assert result.max_abs_diff <= 1e-3  # the self-check ran the program against that reference
    core = Core.open(tmp_path / "core")
    got = run_prompt(core.load_program(), core.load_weights(), core.manifest.kv, PAGE, ids, chunk=PAGE).logprobs
    assert float((got - expected).abs().max()) <= 1e-3


# ---------------------------------------------------------------------------- chat round trips


app = family_checks.served("tiny")


def _check_prompt(app) -> None:
    prompt = app.last_prompt() or ""
    assert prompt.startswith("<｜begin▁of▁sentence｜><|im_start|>system\n")
    assert '"name": "get_weather"' in prompt and "<function=example_function_name>" in prompt  # the tools section
    assert prompt.endswith(f"<|im_start|>user\n{family_checks.ASK}<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize(("route", "finish"), family_checks.TOOL_ROUTES)
def test_reasoning_and_tool_call(app, route: str, finish: str) -> None:
    """Step's reasoning and call come back in each protocol's shape, from the published template's prompt."""
    family_checks.check_think_tool_call(app, route, finish, _check_prompt)


def test_images_are_refused(app) -> None:
    """Text only: the vision tower is not compiled, so image parts are a client error."""
    family_checks.check_images_refused(app)
