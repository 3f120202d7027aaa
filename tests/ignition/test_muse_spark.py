"""The Muse Spark text family: a tiny MuseSparkForConditionalGeneration checkpoint (text weights under
model.language_model., window 8 < 16-token pages, sliding and full layers, a NoPE layer, dense and
MoE layers with experts at their own width, softcapped logits) exported with the muse_spark recipe and
checked against transformers' own MuseSparkForConditionalGeneration, through run_prompt and the
engine; refused variants; and the recipe's think reasoning (no tool syntax) through Chat Completions,
Messages and Responses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helios.core import Core
from helios.core.program import SCORED_PREFILL, run_prompt
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core
from ignition.models import family_of_hf_config, muse_spark
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition import family_checks
from tests.ignition.family_checks import CHAT, LONG_TEXT, TEXTS, check_generation_matches, hf_logprobs

SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # the qwen3 chat flavour


# (tiny Muse Spark checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("muse_spark", "muse_spark", "MuseSparkForConditionalGeneration")


def _prompts(core: Core) -> list[list[int]]:
    """A rendered chat, a short text and a long one (past the window and the first page)."""
    return family_checks.chat_prompts(core, SPECIALS, TEXTS[1], LONG_TEXT, chat=CHAT)


def test_config_reads_the_muse_spark_layout(tiny: tuple[Path, Path]) -> None:
    hf = json.loads((tiny[0] / "config.json").read_text())
    assert family_of_hf_config(hf) == "muse_spark"
    config = muse_spark.config_from_hf(hf)
    assert config.layer_windows == (8, 0, 8, 0)
    assert config.layer_rope == (True, True, True, False)  # the default layer_rope_theta: last layer NoPE
    assert config.layer_sparse == (True, False, True, True)
    assert config.router.logit_scale == config.output_multiplier == 1.5 and config.router.norm_eps == 1e-15
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("muse_spark", "muse_spark", 16)
    assert (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (4, 2, 16)
    assert m.recipe.reasoning_syntax == "think" and m.recipe.tool_syntax is None
    weights = Core.open(tiny[1]).load_weights()
    assert weights["layers.0.wqkvg"].shape == (4 * 16 * 2 + 2 * 2 * 16, 64)  # q, k, v and the output gate
    assert weights["layers.0.w_experts_gate_up"].shape == (8, 64, 48) and "layers.1.w_gate_up" in weights


def test_release_defaults() -> None:
    """A config that leaves fields out reads MuseSparkTextConfig's defaults (the released layout)."""
    from transformers import MuseSparkConfig as HfConfig

    hf = {"architectures": ["MuseSparkForConditionalGeneration"], "model_type": "muse_spark", "text_config": {}}
    config = muse_spark.config_from_hf(hf)
    ref = HfConfig().text_config
    assert (config.num_layers, config.hidden_size, config.head_dim, config.num_kv_heads) == (62, 8192, 64, 16)
    assert config.layer_windows == tuple(ref.sliding_window if t == "sliding_attention" else 0 for t in ref.layer_types)
    assert config.layer_rope == tuple(bool(theta) for theta in ref.layer_rope_theta)
    assert config.layer_sparse == tuple(t == "sparse" for t in ref.mlp_layer_types)
    assert config.rope_theta == ref.rope_parameters["rope_theta"]
    assert config.final_softcap == ref.final_logit_softcapping
    assert (config.qk_scale_factor, config.output_multiplier) == (ref.qk_scale_factor, ref.output_multiplier)
    assert config.placeholder_ids == (200092, 200091, 200038)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quantization_config": {"quant_method": "modelopt"}}, "quantization_config"),
        ({"text_config": {"attention_bias": True}}, "attention_bias"),
        ({"text_config": {"hidden_act": "gelu"}}, "hidden_act"),
        ({"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}}, "rope_type"),
        ({"text_config": {"layer_rope_theta": [10000.0, 20000.0, 10000.0, 0]}}, "layer_rope_theta"),
        ({"text_config": {"tie_word_embeddings": True}}, "tie_word_embeddings"),
        ({"text_config": {"final_logit_softcapping": 0.0}}, "final_logit_softcapping"),
        ({"text_config": {"mlp_layer_types": ["moe"] * 4}}, "mlp_layer_types"),
        ({"text_config": {"layer_types": ["chunked_attention"] * 4}}, "layer_types"),
        ({"text_config": {"sliding_window": 0}}, "sliding_window"),
        ({"text_config": None, "model_type": "muse_spark_text"}, "text_config"),
    ],
)
def test_unsupported_variants_are_refused(tiny: tuple[Path, Path], change: dict, field: str) -> None:
    config = json.loads((tiny[0] / "config.json").read_text())
    change = dict(change)
    text = change.pop("text_config", {})
    config = config | change
    config["text_config"] = None if text is None else config["text_config"] | text
    with pytest.raises(ValueError, match=field):
        muse_spark.config_from_hf(config)


def test_vision_and_audio_towers_are_refused_by_name(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """Only the text model compiles: a checkpoint carrying tower weights fails export naming the tensor."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for f in tiny[0].iterdir():
        (checkpoint / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.vision_tower.ln_pre.weight"] = torch.ones(32)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(SourceError, match="model.vision_tower.ln_pre.weight"):
        export_core(open_source(str(checkpoint)), load_recipe("muse_spark"), ExportOptions(out=tmp_path / "core"))


def test_reference_forward_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """The export self-check's float64 reference against transformers' fp32 forward."""
    source = open_source(str(tiny[0]))
    config = muse_spark.config_from_hf(source.hf_config)
    for ids in _prompts(Core.open(tiny[1])):
        ours = torch.log_softmax(muse_spark.reference_logits(config, source.tensors, ids), dim=-1)
        assert float((ours - hf_logprobs(reference, ids)).abs().max()) <= 1e-3


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Three prompts (one past the window and a page) prefilled whole, in chunks of 16 and 5, and decoded
    token by token."""
    core = Core.open(tiny[1])
    prompts = _prompts(core)
    assert max(len(p) for p in prompts) > core.manifest.limits.page_tokens > 8
    # whole, in chunks of 16 and 5, then token by token past the first page
    worst = family_checks.step_logprob_error(tiny[1], reference, prompts, decoded=core.manifest.limits.page_tokens + 4)
    print(f"max |Δ logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3


def test_prompt_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    core = Core.open(tiny[1])
    program, weights, m = core.load_program(SCORED_PREFILL), core.load_weights(), core.manifest
    for ids in _prompts(core):
        run = run_prompt(program, weights, m.kv, m.limits.page_tokens, ids, chunk=16)
        expected = hf_logprobs(reference, ids)
        scored = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert float((run.outputs["prompt_logprobs"][:-1] - scored).abs().max()) <= 1e-3
        top = expected[:-1].topk(3, dim=-1)
        assert torch.equal(run.outputs["prompt_top_ids"][:-1, :3], top.indices)
        assert float((run.outputs["prompt_top_logprobs"][:-1, :3] - top.values).abs().max()) <= 1e-3


def test_placeholder_ids_embed_as_token_zero(tiny: tuple[Path, Path], reference) -> None:
    """Image/video/audio placeholders without media are token 0 to the wrapper, and to the core."""
    core = Core.open(tiny[1])
    program, weights, m = core.load_program(), core.load_weights(), core.manifest
    placeholders = muse_spark.config_from_hf(json.loads((tiny[0] / "config.json").read_text())).placeholder_ids
    ids = core.tokenizer().encode(TEXTS[1]).ids + list(placeholders) + [7, 8]
    got = run_prompt(program, weights, m.kv, m.limits.page_tokens, ids).logprobs
    zeroed = [0 if t in placeholders else t for t in ids]
    assert torch.equal(got, run_prompt(program, weights, m.kv, m.limits.page_tokens, zeroed).logprobs)
    assert float((got - hf_logprobs(reference, ids)).abs().max()) <= 1e-3


@pytest.mark.parametrize("text", [TEXTS[0] + " " + TEXTS[3], TEXTS[1], TEXTS[2]])
def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference, text: str) -> None:
    """Greedy tokens' logprobs and top alternatives through the engine (windowed decode rows, pages)."""
    check_generation_matches(tiny[1], reference, text, 16)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """8 prompts together == each alone, prefix cache on and off, 16-token prefill chunks, and again
    from cached prefix pages."""
    family_checks.check_eight_prompts_batching(tiny[1])


# ---------------------------------------------------------------------------- chat round trip

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
CALL_JSON = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
CALL_TEXT = "<tool_call>" + CALL_JSON + "</tool_call>"  # the tags are special tokens: not shown as text
OUTPUT = "<think>The user wants weather.</think>It is sunny in Paris."
# The tiny core behind the in-process server, with a scripted model.
app = family_checks.served("tiny")
ASKED = [{"role": "user", "content": "Weather in Paris?"}]
# route -> (path, the request's own fields, headers)
ROUTES = {
    "chat": ("/v1/chat/completions", {"max_tokens": 256, "messages": ASKED}, {}),
    "messages": ("/v1/messages", {"max_tokens": 256, "messages": ASKED}, family_checks.VERSION),
    "responses": ("/v1/responses", {"max_output_tokens": 256, "input": "Weather in Paris?", "store": False}, {}),
}


def _ask(app, route: str, **body) -> dict:
    """The response to "Weather in Paris?" through `route`, `body` added to the request."""
    path, fields, headers = ROUTES[route]
    response = app.post(path, json={"model": "x", **fields, **body}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_reasoning_through_chat_messages_and_responses(app) -> None:
    """The qwen3 template renders the request; the recipe's think parser splits the scripted output."""
    app.say(OUTPUT)
    body = _ask(app, "chat")
    assert app.last_prompt().endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "The user wants weather."
    assert choice["message"]["content"] == "It is sunny in Paris." and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0

    app.say(OUTPUT)
    message = _ask(app, "messages")
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == [
        ("thinking", "The user wants weather."),
        ("text", "It is sunny in Paris."),
    ]
    assert message["stop_reason"] == "end_turn"

    app.say(OUTPUT)
    response = _ask(app, "responses")
    items = [(i["type"], i["content"][0]["text"]) for i in response["output"]]
    assert items == [("reasoning", "The user wants weather."), ("message", "It is sunny in Paris.")]
    assert response["status"] == "completed" and response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_tools_without_a_tool_syntax_stay_text(app) -> None:
    """The recipe declares no tool syntax: helios still renders declared tools through the template,
    but parses no calls, so a call the model writes comes back as answer text on every route (its
    special-token tags are left out of the text, as every special token is)."""
    output = "<think>Check the weather.</think>" + CALL_TEXT
    app.say(output)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    body = _ask(app, "chat", tools=[tool])
    assert '"get_weather"' in app.last_prompt()  # qwen3's template declares the tool
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Check the weather."
    assert message["content"] == CALL_JSON and not message.get("tool_calls")
    assert body["choices"][0]["finish_reason"] == "stop"

    app.say(output)
    message = _ask(app, "messages", tools=[{"name": "get_weather", "input_schema": CITY}])
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][1]["text"] == CALL_JSON and message["stop_reason"] == "end_turn"

    app.say(output)
    response = _ask(app, "responses", tools=[{"type": "function", "name": "get_weather", "parameters": CITY}])
    assert [i["type"] for i in response["output"]] == ["reasoning", "message"]
    assert response["output"][1]["content"][0]["text"] == CALL_JSON and response["status"] == "completed"


def test_required_tool_choice_is_refused(app) -> None:
    """With no tool parser no call can ever complete, so tool_choice "required" (and a named tool)
    is refused up front with the protocol's 400, before anything is generated."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        response = app.post(
            "/v1/chat/completions",
            json={
                "model": "x",
                "max_tokens": 64,
                "tools": [tool],
                "tool_choice": choice,
                "messages": [{"role": "user", "content": "Weather?"}],
            },
        )
        assert response.status_code == 400 and "declares no tool-call syntax" in response.json()["error"]["message"]
    response = app.post(
        "/v1/messages",
        headers=family_checks.VERSION,
        json={
            "model": "x",
            "max_tokens": 64,
            "tools": [{"name": "get_weather", "input_schema": CITY}],
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather?"}],
        },
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = app.post(
        "/v1/responses",
        json={
            "model": "x",
            "max_output_tokens": 64,
            "input": "Weather?",
            "store": False,
            "tool_choice": "required",
            "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}],
        },
    )
    assert response.status_code == 400 and "declares no tool-call syntax" in response.json()["error"]["message"]
