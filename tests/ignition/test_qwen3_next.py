"""The qwen3_next family (gated DeltaNet + gated attention hybrids): tiny Qwen3-Next (MoE),
Qwen3.5 (dense) and Qwen3.5-MoE checkpoints exported with the qwen38 / qwen38_dense recipes and
checked against transformers' own Qwen3NextForCausalLM / Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM (eager attention, torch gated delta rule): the programs prefilled whole,
in 16-, 5- and 1-token chunks (the recurrent state crossing every chunk boundary), prompt
logprobs, engine generation, batching invariance and prefix reuse over the state slots, the
multimodal checkpoint layout, refused variants, and the recipes' parsers through Chat
Completions, Messages and Responses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family_of_hf_config, qwen3_next, qwen3_next_reference
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition import family_checks
from tests.ignition.family_checks import (
    CHAT,
    EIGHT_PLAIN_TEXTS,
    LONGER_TEXT,
    RESULT,
    check_batching_invariance,
    check_prefix_reuse,
    read_turn,
    tool_result_turns,
)

PAGE_TOKENS = 16
_MOE_FIELDS = (
    "mlp_only_layers",
    "decoder_sparse_step",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
# name -> (config changes, fields dropped, recipe, transformers class). qwen3_next is the family's
# own test checkpoint (fused per-key-head projections, per-expert tensors, a dense layer among MoE
# ones); qwen3_5: separate projections, every 2nd layer full attention from full_attention_interval,
# dense MLPs, tied embeddings; qwen3_5_moe: separate projections, stacked experts, every layer MoE.
VARIANTS: dict[str, tuple[dict, tuple[str, ...], str, str]] = {
    "qwen3_next": ({}, (), "qwen38", "Qwen3NextForCausalLM"),
    "qwen3_5": (
        {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "full_attention_interval": 2,
            "tie_word_embeddings": True,
        },
        ("layer_types", *_MOE_FIELDS),
        "qwen38_dense",
        "Qwen3_5ForCausalLM",
    ),
    "qwen3_5_moe": (
        {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"},
        ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size"),
        "qwen38",
        "Qwen3_5MoeForCausalLM",
    ),
}


def write_variant(out: Path, name: str, seed: int, extra: dict | None = None) -> Path:
    """A tiny checkpoint of VARIANTS[name] (tensors regenerated for its config), `extra` config fields added."""
    changes, dropped, _, _ = VARIANTS[name]
    return family_checks.write_variant("qwen3_next", out, changes | (extra or {}), seed, dropped)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(variant name, tiny checkpoint, its core with prompt logprobs, transformers' model)."""
    name = request.param
    checkpoint = write_variant(tmp_path_factory.mktemp("ckpt") / f"tiny-{name}", name, seed=3)
    core = tmp_path_factory.mktemp("cores") / f"tiny-{name}"
    result = export_core(
        open_source(str(checkpoint)),
        load_recipe(VARIANTS[name][2]),
        ExportOptions(out=core, prompt_logprobs=True, page_tokens=PAGE_TOKENS),
    )
    assert result.max_abs_diff <= 1e-3  # the self-check against the float64 reference
    return name, checkpoint, core, family_checks.hf_model(checkpoint, VARIANTS[name][3])


def _prompts(core: Core) -> list[list[int]]:
    """A chat through the qwen3.5 template, a short text and one spanning several chunks and pages."""
    return family_checks.chat_prompts(core, {"eos_token": "<|im_end|>"}, "Hi there", LONGER_TEXT, chat=CHAT)


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_core_records_the_recipe_and_state_layout(exported) -> None:
    name, _, core_dir, _ = exported
    m = Core.open(core_dir).manifest
    config = qwen3_next.FAMILY.config_from_hf(json.loads((exported[1] / "config.json").read_text()))
    assert (m.model.family, m.recipe.name) == ("qwen3_next", VARIANTS[name][2])
    assert m.kv.num_layers == config.num_layers and (m.kv.num_kv_heads, m.kv.head_dim) == (2, 32)
    conv, recurrent = m.kv.state
    assert (conv.name, conv.layers, conv.shape) == ("conv", config.linear_layers, (128, 3))
    assert (recurrent.name, recurrent.layers, recurrent.shape) == ("recurrent", config.linear_layers, (4, 16, 16))
    assert {"causal_conv1d", "gated_delta_rule"} <= set(m.ops.ops)
    assert config.layer_types.count("full_attention") >= 1 and len(config.linear_layers) >= 2


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_logprobs_match_transformers(exported) -> None:
    """Three prompts, prefilled whole and in chunks of 16 and 5 and (their first 20 tokens) one
    token at a time, every chunk after the first starting from the state slots; and the scored
    prefill's prompt logprobs."""
    _, _, core_dir, model = exported
    prompts = _prompts(Core.open(core_dir))
    assert len(prompts[2]) > 4 * PAGE_TOKENS
    worst = family_checks.step_logprob_error(core_dir, model, prompts, decoded=PAGE_TOKENS + 4)  # past the first page
    worst = max(worst, family_checks.prompt_logprob_error(core_dir, model, prompts, chunk=16))
    print(f"max |Δ logprob| vs transformers (programs): {worst:.3g}")
    assert worst <= 1e-3


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_engine_generation_matches_transformers(exported) -> None:
    """Greedy generation through the engine (16-token prefill chunks, then decode rows through the
    state slots): each token's logprob and top alternatives equal transformers' on the whole
    sequence, for the three prompts."""
    _, _, core_dir, model = exported
    worst = family_checks.engine_logprob_error(core_dir, model, _prompts(Core.open(core_dir)))
    print(f"max |Δ logprob| vs transformers (engine): {worst:.3g}")
    assert worst <= 1e-3


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_batching_invariance(exported) -> None:
    """8 prompts together (mixed prefill chunks and decode rows over the state slots) == each
    alone, with the prefix cache on and off."""
    check_batching_invariance(exported[2], EIGHT_PLAIN_TEXTS)


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_prefix_reuse(exported) -> None:
    check_prefix_reuse(exported[2], LONGER_TEXT, 8)


# ------------------------------------------------------------------------- config and layout


def test_multimodal_checkpoint_layout_reads_the_same_model(tmp_path: Path) -> None:
    """Qwen3_5MoeForConditionalGeneration-style checkpoints: the config under text_config, the text
    weights under model.language_model., a vision tower and an MTP head export leaves out."""
    checkpoint = open_source(str(write_variant(tmp_path / "ckpt", "qwen3_5_moe", seed=2)))
    flat = checkpoint.hf_config
    nested = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {**flat, "model_type": "qwen3_5_moe_text"},
        "vision_config": {"depth": 1},
    }
    assert family_of_hf_config(nested) == "qwen3_next"
    config = qwen3_next.FAMILY.config_from_hf(nested)
    assert config == qwen3_next.FAMILY.config_from_hf(flat)
    renamed = {
        ("model.language_model." + n[len("model.") :] if n.startswith("model.") else n): t
        for n, t in checkpoint.tensors.items()
    }
    renamed |= {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3), "mtp.fc.weight": torch.zeros(4, 8)}
    ids = list(range(3, 30))
    assert torch.equal(
        qwen3_next_reference.reference_logits(config, renamed, ids),
        qwen3_next_reference.reference_logits(config, checkpoint.tensors, ids),
    )
    ours = internal_weights(qwen3_next.FAMILY, replace(checkpoint, tensors=renamed), config, torch.float32)
    plain = internal_weights(qwen3_next.FAMILY, checkpoint, config, torch.float32)
    assert ours.keys() == plain.keys() and all(torch.equal(ours[n], plain[n]) for n in plain)
    assert plain["layers.0.wqkvz"].shape == (config.conv_dim + config.value_dim, config.hidden_size)
    assert plain["layers.0.w_experts_gate_up"].shape == (4, 64, 64)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}}, "rope_type"),
        ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
            "layer_types",
        ),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_variants_are_refused(change: dict, field: str) -> None:
    config = qwen3_next.testmodel_config(300) | change
    with pytest.raises(ValueError, match=field):
        qwen3_next.FAMILY.config_from_hf(config)


def test_dense_layers_follow_the_sparse_step() -> None:
    """Qwen3-Next's decoder_sparse_step / mlp_only_layers, as Qwen3NextDecoderLayer reads them."""
    config = qwen3_next.FAMILY.config_from_hf(
        qwen3_next.testmodel_config(300) | {"decoder_sparse_step": 2, "mlp_only_layers": []}
    )
    assert config.moe_layers == (False, True, False, True)
    assert qwen3_next.FAMILY.config_from_hf(qwen3_next.testmodel_config(300)).moe_layers == (True, False, True, True)


# ---------------------------------------------------------------------------- chat round trips

ANSWER, THINK = "It is sunny.", "The user wants weather."
ARGUMENTS = {"city": "Paris", "days": 3}
OUTPUT = (
    f"{THINK}\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
FINAL = f"Done.\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module", params=["qwen38", "qwen38_dense"])
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tiny core of the recipe served in process; the scripted model writes Qwen3.5 syntax."""
    from server.scripted import scripted_app  # tests/ is on sys.path

    name = {"qwen38": "qwen3_next", "qwen38_dense": "qwen3_5"}[request.param]
    checkpoint = write_variant(tmp_path_factory.mktemp("ckpt") / f"chat-{name}", name, seed=6)
    core = tmp_path_factory.mktemp("cores") / f"chat-{name}"
    export_core(open_source(str(checkpoint)), load_recipe(request.param), ExportOptions(out=core))
    with scripted_app(core) as server:
        yield server


# route -> finish reason (or status) of the call turn, then of the final turn.
FINISH = {"chat": ("tool_calls", "stop"), "messages": ("tool_use", "end_turn"), "responses": ("completed", "completed")}


def _stripped(turn: dict) -> dict:
    """read_turn's reading without the newlines Qwen3.5's turns carry around the reasoning and text."""
    return turn | {"reasoning": turn["reasoning"].strip(), "text": turn["text"].strip()}


@pytest.mark.sampled  # one variant and route in CI, all with FLARE_SLOW_TESTS=1
@pytest.mark.parametrize("route", sorted(FINISH))
def test_tool_call_round_trip(app, route: str) -> None:
    """The call turn (reasoning, text, a qwen3_coder call) and, with its result in the history, the
    final turn, through each protocol and the recipe's template and parsers."""
    reply, prompt, final, final_prompt = tool_result_turns(app, route, OUTPUT, FINAL)
    call_finish, final_finish = FINISH[route]
    assert _stripped(read_turn(route, reply)) == {
        "parts": ["reasoning", "text", "call"],
        "reasoning": THINK,
        "text": "Checking.",
        "calls": [("get_weather", ARGUMENTS)],
        "finish": call_finish,
    }
    assert _stripped(read_turn(route, final)) == {
        "parts": ["reasoning", "text"],
        "reasoning": "Done.",
        "text": ANSWER,
        "calls": [],
        "finish": final_finish,
    }
    if route == "chat":
        assert prompt.endswith("<|im_start|>assistant\n<think>\n") and '"name": "get_weather"' in prompt
        assert (
            f"<tool_response>\n{RESULT}\n</tool_response>" in final_prompt and "<function=get_weather>" in final_prompt
        )
    else:
        assert RESULT in final_prompt and "Paris" in final_prompt


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mtp_layer_exports_as_a_drafter_program_matching_the_reference(name: str, tmp_path: Path) -> None:
    """mtp_num_hidden_layers = 1: the step also returns its final-normed hidden states and the MTP
    layer becomes mtp_draft.0 (dense MLP for Qwen3.5, routed for the MoE lines), both matching the
    float64 reference; the same checkpoint with the field removed exports without them."""
    from safetensors.torch import load_file

    from helios.core.program import run_prompt
    from ignition.models import mtp, qwen3_next_reference

    checkpoint = write_variant(tmp_path / "ckpt", name, seed=5, extra={"mtp_num_hidden_layers": 1})
    out = tmp_path / "core"
    export_core(open_source(str(checkpoint)), load_recipe(VARIANTS[name][2]), ExportOptions(out=out, page_tokens=16))
    core = Core.open(out)
    config = qwen3_next.FAMILY.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    assert config.mtp_moe is (name != "qwen3_5") and "mtp_draft.0" in core.manifest.programs
    assert [e.name for e in core.manifest.kv.extra] == ["mtp_kv", "mtp_kv"]  # keys, then values
    hf, weights, kv = load_file(str(checkpoint / "model.safetensors")), core.load_weights(), core.manifest.kv
    ids = [(11 * t + 5) % config.vocab_size for t in range(37)]
    hidden = run_prompt(core.load_program(), weights, kv, 16, ids).outputs["hidden_states"]
    expected = qwen3_next_reference.reference_forward(config, hf, ids)[1]
    assert float((hidden - expected).abs().max()) <= 1e-4
    error = mtp.check_against_reference(
        core.load_program("mtp_draft.0"),
        weights,
        kv,
        16,
        config.vocab_size,
        lambda i: qwen3_next_reference.reference_forward(config, hf, i)[1],
        lambda n, h: qwen3_next_reference.reference_mtp(config, hf, 0, n, h)[0],
    )
    assert error <= 1e-4
    # without the config field the mtp.* tensors are left out, as transformers leaves them
    plain = {
        k: v for k, v in json.loads((checkpoint / "config.json").read_text()).items() if k != "mtp_num_hidden_layers"
    }
    (checkpoint / "config.json").write_text(json.dumps(plain))
    export_core(
        open_source(str(checkpoint)), load_recipe(VARIANTS[name][2]), ExportOptions(out=out, page_tokens=16, force=True)
    )
    assert "mtp_draft.0" not in Core.open(out).manifest.programs and not Core.open(out).manifest.kv.extra
