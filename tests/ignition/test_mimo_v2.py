"""The mimo_v2 family (MiMo-V2-Flash): a tiny checkpoint in the hub's spellings (window 8 < 16-token
pages, full and sliding layers with 1 / 2 kv heads, 24-wide keys and 16-wide values, sinks, partial
rotary with a theta per type, dense and sigmoid-routed MoE layers, one MTP layer) exported with the
mimo_v2 recipe and checked against transformers' own MiMoV2FlashForCausalLM (eager attention)
through run_prompt and the engine; the flare::sink_attention kernel against its reference; the
MTP draft program against the family's reference and a transformers-built MTP block; the recipe's
template and parsers end to end through Chat Completions, Messages and Responses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from helios.core import Core
from helios.core.program import run_prompt
from helios.engine import EngineConfig, build_engine
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family_of_hf_config, mimo_v2
from ignition.models.mtp import run_mtp_prompt
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition import family_checks
from tests.ignition.family_checks import LONG_TEXT, TEXTS, hf_logprobs

PAGE = 16
WINDOW = 8
# (tiny MiMo-V2-Flash checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("mimo_v2", "mimo_v2", "MiMoV2FlashForCausalLM")


def _prompts(core: Core) -> list[list[int]]:
    """A rendered chat (the test template), a long text and a short one."""
    return family_checks.chat_prompts(core, {"eos_token": "<|im_end|>"}, LONG_TEXT, TEXTS[2])


def test_config_and_core_record_the_mimo_layout(tiny: tuple[Path, Path]) -> None:
    hf = json.loads((tiny[0] / "config.json").read_text())
    assert family_of_hf_config(hf) == "mimo_v2"
    c = mimo_v2.FAMILY.config_from_hf(hf)
    assert c.layer_windows == (0, WINDOW, WINDOW, 0, WINDOW)  # sliding_window_size 7 + the query
    assert c.layer_sparse == (False, True, True, False, True) and c.num_mtp_layers == 1
    assert (c.rope_full.dim, c.rope_full.pairs, c.rope_sliding.dim) == (8, 4, 12)  # int(24 * 0.334), int(24 * 0.5)
    assert (c.kv_heads(False), c.kv_heads(True), c.value_scale) == (1, 2, 0.707)
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("mimo_v2", "mimo_v2", PAGE)
    assert (m.recipe.reasoning_syntax, m.recipe.tool_syntax, m.recipe.template_source) == (
        "think",
        "mimo",
        "checkpoint",
    )
    # one packed key|value tensor per layer: 2 kv heads x (24 + 16), then the MTP layer's
    assert m.kv.shared_kv and (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (5, 2, 40)
    assert [(e.name, e.layers) for e in m.kv.extra] == [("mtp_kv", (5,))] and m.kv.num_caches == 6
    assert "sink_attention" in m.ops.ops
    assert sorted(m.programs) == ["mtp_draft.0", "scored_prefill", "step"]
    assert m.programs["step"].outputs[-1].name == "hidden_states"
    assert m.programs["step"].outputs[-1].shape == ("T", 64)


def test_transformers_spellings_read_the_same_config(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers' saved config (sliding_window already + 1) reads as the hub's; a hub config
    without layer_types / mlp_layer_types / rope_parameters gets transformers' defaults."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(tiny[0])).save_pretrained(str(tmp_path))
    native = json.loads((tmp_path / "config.json").read_text())
    ours = json.loads((tiny[0] / "config.json").read_text())
    assert native["sliding_window"] == WINDOW
    assert mimo_v2.FAMILY.config_from_hf(native) == mimo_v2.FAMILY.config_from_hf(ours)
    hub = {
        k: v
        for k, v in ours.items()
        if k not in ("layer_types", "mlp_layer_types", "rope_parameters", "hybrid_layer_pattern", "moe_layer_freq")
    }
    hub |= {
        "num_hidden_layers": 7,
        "rope_theta": 5_000_000.0,
        "swa_rope_theta": 10_000.0,
        "partial_rotary_factor": 0.334,
        "routed_scaling_factor": None,
        "attention_value_scale": None,
    }
    c = mimo_v2.FAMILY.config_from_hf(hub)
    assert c.layer_windows == (0, WINDOW, WINDOW, WINDOW, WINDOW, 0, WINDOW)  # full at 0 and every 6th
    assert c.layer_sparse == (False,) + (True,) * 6
    assert (c.rope_full.theta, c.rope_sliding.theta, c.rope_sliding.dim) == (5e6, 1e4, 8)
    assert (c.router.routed_scaling_factor, c.value_scale) == (1.0, 1.0)


_ROPE_SLIDING = {"rope_type": "default", "rope_theta": 1e4}
# name -> (config changes, the field the refusal names)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "attention_bias": ({"attention_bias": True}, "attention_bias"),
    "shared_experts": ({"n_shared_experts": 1}, "n_shared_experts"),
    "full_sinks": ({"add_full_attention_sink_bias": True}, "add_full_attention_sink_bias"),
    "no_swa_sinks": ({"add_swa_attention_sink_bias": False}, "add_swa_attention_sink_bias"),
    "softmax_router": ({"scoring_func": "softmax"}, "scoring_func"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act"),
    "yarn": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                "sliding_attention": _ROPE_SLIDING,
            }
        },
        "rope_type",
    ),
    "flat_rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    "odd_rotary": (
        {
            "head_dim": 23,
            "rope_parameters": {
                "sliding_attention": _ROPE_SLIDING,
                "full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
            },
        },
        "partial_rotary_factor",
    ),
    "swa_kv_heads": ({"swa_num_key_value_heads": 4}, "swa_num_key_value_heads"),
    "swa_head_dim": ({"swa_head_dim": 32}, "swa_head_dim"),
    "swa_v_head_dim": ({"swa_v_head_dim": 24}, "swa_v_head_dim"),
    "kv_heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "pattern_disagrees": ({"hybrid_layer_pattern": [0, 1, 1, 1, 1]}, "hybrid_layer_pattern"),
    "moe_freq_disagrees": ({"moe_layer_freq": [0, 1, 1, 1, 1]}, "moe_layer_freq"),
    "layer_types": (
        {
            "layer_types": [
                "full_attention",
                "chunked_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ]
        },
        "layer_types",
    ),
    "hub_rope_theta": ({"rope_parameters": None, "rope_theta": 1e6}, "rope_theta"),
    "hub_partial_rotary": ({"rope_parameters": None, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "eps_disagrees": ({"layernorm_epsilon": 1e-6}, "layernorm_epsilon"),
    "no_window": ({"sliding_window": 0, "sliding_window_size": None}, "sliding_window"),
    "quantized": ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_variants_are_refused(name: str) -> None:
    changes, field = REFUSED[name]
    config = {k: v for k, v in (mimo_v2.testmodel_config(300) | changes).items() if v is not None}
    with pytest.raises(ValueError, match=f"^{field}|\\.{field} "):
        mimo_v2.FAMILY.config_from_hf(config)


def test_reference_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """The self-check's float64 reference is transformers' model (logits and final hidden states)."""
    checkpoint = open_source(str(tiny[0]))
    config = mimo_v2.FAMILY.config_from_hf(checkpoint.hf_config)
    ids = list(range(5, 60))
    logits, hidden = mimo_v2.reference_forward(config, checkpoint.tensors, ids)
    assert float((torch.log_softmax(logits, dim=-1) - hf_logprobs(reference, ids)).abs().max()) <= 2e-4
    with torch.no_grad():
        expected = reference.model(torch.tensor([ids])).last_hidden_state[0]
    assert float((hidden - expected).abs().max()) <= 1e-4


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Prompts longer than the window and than a page, prefilled whole, in chunks of 16 and 5, and
    token by token past the first page (decode rows whose window has slid); and their prompt logprobs."""
    prompts = _prompts(Core.open(tiny[1]))
    assert all(len(ids) > PAGE > WINDOW for ids in prompts[:2])
    family_checks.check_program_logprobs(tiny[1], reference, prompts)


@pytest.mark.parametrize("text", [LONG_TEXT, TEXTS[1], TEXTS[2]])
def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference, text: str) -> None:
    """The engine's greedy tokens (16-token prefill chunks, windowed decode rows through helios'
    sink_attention kernel) carry transformers' logprobs and top alternatives on the whole sequence."""
    family_checks.check_generation_matches(tiny[1], reference, text, 16)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """8 prompts together == each alone, prefix cache on and off, 16-token prefill chunks."""
    core = Core.open(tiny[1])
    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    assert len(solo.executor.kv) == 6 and tuple(solo.executor.kv[0].shape) == (128, PAGE, 2, 40)
    family_checks.check_eight_prompts_batching(tiny[1])


def test_transformers_layout_reads_the_same_weights(tiny: tuple[Path, Path], reference) -> None:
    """transformers' in-memory names (self_attn.sinks, stacked mlp.experts.gate_up_proj) read as the
    hub's (attention_sink_bias, per-expert tensors); MTP layers past num_nextn_predict_layers are left out."""
    checkpoint = open_source(str(tiny[0]))
    config = mimo_v2.FAMILY.config_from_hf(checkpoint.hf_config)
    native = {n: t for n, t in reference.state_dict().items() if "rotary_emb" not in n}
    assert "model.layers.1.self_attn.sinks" in native and "model.layers.1.mlp.experts.gate_up_proj" in native
    plain = internal_weights(mimo_v2.FAMILY, checkpoint, config, torch.float32)
    renamed = internal_weights(mimo_v2.FAMILY, replace(checkpoint, tensors=native), config, torch.float32)
    main = {n for n in plain if not n.startswith("mtp.")}
    assert renamed.keys() == main and all(torch.equal(renamed[n], plain[n]) for n in main)
    assert plain["layers.1.w_experts_gate_up"].shape == (8, 64, 64) and "layers.0.w_gate_up" in plain
    ids = list(range(3, 40))
    assert torch.equal(
        mimo_v2.reference_logits(config, native, ids), mimo_v2.reference_logits(config, checkpoint.tensors, ids)
    )
    no_mtp = replace(config, num_mtp_layers=0)
    assert not any(n.startswith("mtp.") for n in internal_weights(mimo_v2.FAMILY, checkpoint, no_mtp, torch.float32))
    with pytest.raises(SourceError, match="num_nextn_predict_layers"):  # save_pretrained drops model.mtp.*
        mimo_v2.extra_programs(config, 2, renamed)
    bad = replace(checkpoint, tensors=checkpoint.tensors | {"model.layers.1.self_attn.q_norm.weight": torch.ones(24)})
    with pytest.raises(SourceError, match="q_norm"):
        internal_weights(mimo_v2.FAMILY, bad, config, torch.float32)


def test_tied_variant_with_transformers_defaults_matches(tmp_path: Path) -> None:
    """Tied embeddings, no MTP, equal key and value widths, and transformers' defaults where the hub
    leaves fields out (layer types, dense-first MLPs, rope thetas 5e6 / 1e4 at 0.334, which on
    16-wide heads is an odd d = 5: three pairs, six dims, rotate; value scale 0.707): reference
    and exported core against transformers."""
    dropped = ("layer_types", "hybrid_layer_pattern", "mlp_layer_types", "moe_layer_freq", "rope_parameters")
    dropped += ("attention_value_scale", "num_nextn_predict_layers")
    changes = {"tie_word_embeddings": True, "num_hidden_layers": 6, "head_dim": 16, "v_head_dim": 16}
    checkpoint = family_checks.write_variant("mimo_v2", tmp_path / "ckpt", changes, 5, dropped)
    parsed = mimo_v2.FAMILY.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    assert parsed.layer_windows == (0, WINDOW, WINDOW, WINDOW, WINDOW, 0) and parsed.value_scale == 0.707
    assert (parsed.rope_full.dim, parsed.rope_full.pairs, parsed.rope_sliding.theta) == (5, 3, 1e4)
    model = family_checks.hf_model(checkpoint, "MiMoV2FlashForCausalLM")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = list(range(7, 47))
    expected = hf_logprobs(model, ids)
    ours = torch.log_softmax(mimo_v2.reference_logits(parsed, open_source(str(checkpoint)).tensors, ids), dim=-1)
    assert float((ours - expected).abs().max()) <= 2e-4
    result = export_core(open_source(str(checkpoint)), load_recipe("mimo_v2"), ExportOptions(out=tmp_path / "core"))
    assert result.max_abs_diff <= 1e-3 and "mtp_draft.0" not in result.manifest.programs
    assert not result.manifest.kv.extra and result.manifest.programs["step"].outputs[-1].name != "hidden_states"
    core = Core.open(tmp_path / "core")
    got = run_prompt(core.load_program(), core.load_weights(), core.manifest.kv, PAGE, ids, chunk=PAGE).logprobs
    assert float((got - expected).abs().max()) <= 1e-3


# ------------------------------------------------------------------ flare::sink_attention


def test_sink_attention_kernel_matches_reference() -> None:
    """helios' CPU kernel == the op's reference: mixed decode rows and prefill chunks (whole and
    partial histories), windows, sinks on and off, GQA, a strided view of the cache (full layers)."""
    from helios.core.ops.sinks import sink_attention
    from helios.engine.kernels.sinks import sink_attention_cpu

    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(12, 4, 4, 8 + 5, generator=generator)  # 4 kv heads of 8-wide keys and 5-wide values
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 0, 0], [8, 9, 10, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 10, 6, 1], dtype=torch.int32)
    starts = torch.tensor([0, 1, 8, 14, 15], dtype=torch.int32)  # a decode row, a chunk, a whole prompt, one token
    positions = torch.tensor([8, *range(3, 10), *range(6), 0])
    q = torch.randn(15, 6, 8, generator=generator)
    for rows in (cache[:, :, :2], cache[:, :, :2].contiguous(), cache[:, :, :3]):
        for window in (0, 3, 5):
            for sinks in (None, torch.randn(6, generator=generator)):
                want = sink_attention(q, rows, tables, seq_lens, starts, positions, 0.3, window, sinks)
                got = sink_attention_cpu(q, rows, tables, seq_lens, starts, positions, 0.3, window, sinks)
                assert got.shape == (15, 6, 5) and float((got - want).abs().max()) <= 1e-5
    # without sinks and with equal widths it is flare::paged_attention over the split halves
    packed = torch.randn(12, 4, 2, 16, generator=generator)
    plain = torch.ops.flare.paged_attention(
        q, packed[..., :8].contiguous(), packed[..., 8:].contiguous(), tables, seq_lens, starts, positions, 0.3, 3
    )
    assert float((sink_attention(q, packed, tables, seq_lens, starts, positions, 0.3, 3) - plain).abs().max()) <= 1e-5


def test_sinks_take_weight_from_the_visible_keys() -> None:
    """A sink only adds to the denominator: a huge sink sends a head's output to zero, a very
    negative one leaves plain attention."""
    from helios.core.ops.sinks import sink_attention

    cache = torch.randn(2, 4, 1, 6)
    args = (
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32),
        torch.arange(5),
        0.5,
        0,
    )
    q = torch.randn(5, 2, 3)
    plain = sink_attention(q, cache, *args)
    sunk = sink_attention(q, cache, *args, torch.tensor([80.0, -80.0]))
    assert float(sunk[:, 0].abs().max()) < 1e-6 and torch.allclose(sunk[:, 1], plain[:, 1], atol=1e-6)


# ---------------------------------------------------------------------------- MTP draft program


def _transformers_mtp_block(checkpoint: Path, tensors: dict[str, torch.Tensor]):
    """The MTP layer's decoder block and final norm as a one-layer MiMoV2FlashModel (a sliding
    layer with a dense MLP), loaded with model.mtp.layers.0's weights: transformers' own attention
    (sinks, window, partial rotary, value scale) for the MTP layer, fed by inputs_embeds."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashModel

    hf = json.loads((checkpoint / "config.json").read_text())
    drop = ("num_hidden_layers", "layer_types", "hybrid_layer_pattern", "mlp_layer_types", "moe_layer_freq")
    config = MiMoV2FlashConfig(
        **{k: v for k, v in hf.items() if k not in drop},
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        mlp_layer_types=["dense"],
    )
    config._attn_implementation = "eager"
    block = MiMoV2FlashModel(config).eval()
    prefix = "model.mtp.layers.0."
    state = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors[prefix + "final_layernorm.weight"],
    }
    for name, tensor in tensors.items():
        inner = name[len(prefix) :]
        if name.startswith(prefix) and not inner.startswith(("enorm", "hnorm", "eh_proj", "final_layernorm")):
            inner = inner.replace("attention_sink_bias", "sinks").replace(
                "pre_mlp_layernorm", "post_attention_layernorm"
            )
            state["layers.0." + inner] = tensor
    missing, unexpected = block.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in n for n in missing), (missing, unexpected)
    return block


def test_mtp_program_matches_references(tiny: tuple[Path, Path], reference) -> None:
    """mtp_draft.0 fed the step program's own hidden_states output (== transformers' final-normed
    hidden states): its logprobs equal the family's reference_mtp and an MTP built from transformers'
    modules, prefilled in 16-row chunks and row by row past the first page; its hidden states too."""
    core = Core.open(tiny[1])
    m, weights = core.manifest, core.load_weights()
    checkpoint = open_source(str(tiny[0]))
    config = mimo_v2.FAMILY.config_from_hf(checkpoint.hf_config)
    ids = _prompts(core)[1]  # longer than the window and a page
    assert len(ids) > PAGE + 4
    with torch.no_grad():
        hf_hidden = reference.model(torch.tensor([ids])).last_hidden_state[0]
    step = run_prompt(core.load_program(), weights, m.kv, PAGE, ids, chunk=PAGE)
    hidden = step.outputs["hidden_states"]
    assert float((hidden - hf_hidden).abs().max()) <= 1e-4
    # row t: the token after position t and the main hidden state at t
    next_ids, rows = ids[1:], hidden[:-1]
    logits, mtp_hidden = mimo_v2.reference_mtp(config, checkpoint.tensors, 0, next_ids, rows)
    ours = torch.log_softmax(logits, dim=-1)
    # transformers' modules: eh_proj(cat(enorm(e), hnorm(h))) into its one-layer model, lm_head after its norm
    t = checkpoint.tensors
    norm = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))  # noqa: E731
    embedded = t["model.embed_tokens.weight"][torch.tensor(next_ids)]
    mtp = "model.mtp.layers.0."
    joined = torch.cat([norm(embedded, t[mtp + "enorm.weight"]), norm(rows, t[mtp + "hnorm.weight"])], dim=-1)
    with torch.no_grad():
        out = _transformers_mtp_block(tiny[0], t)(inputs_embeds=(joined @ t[mtp + "eh_proj.weight"].T)[None])
    hf_mtp_hidden = out.last_hidden_state[0]
    theirs = torch.log_softmax(hf_mtp_hidden @ t["lm_head.weight"].T, dim=-1)
    print(f"max |Δ| of reference_mtp vs the transformers-built MTP: {float((ours - theirs).abs().max()):.3g}")
    assert float((ours - theirs).abs().max()) <= 2e-4 and float((mtp_hidden - hf_mtp_hidden).abs().max()) <= 1e-4
    program = core.load_program("mtp_draft.0")
    worst = 0.0
    for chunk, count in ((PAGE, len(next_ids)), (1, PAGE + 4)):
        got = run_mtp_prompt(program, weights, m.kv, PAGE, next_ids[:count], rows[:count], chunk=chunk)
        worst = max(worst, float((got["logits"] - got["logsumexp"][:, None] - ours[:count]).abs().max()))
        worst = max(worst, float((got["hidden_states"] - mtp_hidden[:count]).abs().max()))
        top = ours[:count].gather(1, got["top_ids"])
        worst = max(worst, float((got["top_logprobs"] - top).abs().max()))
    print(f"max |Δ| of mtp_draft.0 vs reference_mtp: {worst:.3g}")
    assert worst <= 1e-3


# ---------------------------------------------------------------------------- chat round trips

THINK = {"enable_thinking": True}
# What MiMo writes after the prompt's "<|im_start|>assistant\n<think>": compact calls, values verbatim.
OUTPUT = (
    "The user wants weather.</think>Checking.<tool_call>\n<function=get_weather>\n<parameter=city>Paris"
    "</parameter>\n<parameter=days>3</parameter>\n</function>\n</tool_call><|im_end|>"
)


app = family_checks.served("tiny")


def _check_prompt(app, thinking: bool = True) -> None:
    prompt = app.last_prompt() or ""
    assert prompt.startswith("<|im_start|>system\nYou are MiMo, a helpful AI assistant engineered by Xiaomi.")
    assert "<name>get_weather</name>" in prompt and "<parameter=example_parameter_1>value_1</parameter>" in prompt
    tail = "<think>" if thinking else "<think></think>"
    assert prompt.endswith(f"<|im_end|><|im_start|>user\n{family_checks.ASK}<|im_end|><|im_start|>assistant\n{tail}")


@pytest.mark.parametrize(
    ("route", "finish", "extra"),
    [
        ("chat", "tool_calls", {"chat_template_kwargs": THINK}),
        ("messages", "tool_use", {"thinking": family_checks.THINKING}),
        ("responses", "completed", {"chat_template_kwargs": THINK}),
    ],
)
def test_reasoning_and_tool_call(app, route: str, finish: str, extra: dict) -> None:
    """The scripted output's reasoning and call come back in each protocol's shape, thinking on."""
    app.say(OUTPUT)
    got, reason = family_checks.tool_round_trip(app, route, family_checks.ASK, family_checks.CITY, **extra)
    _check_prompt(app)
    assert got == family_checks.WEATHER_CALL and reason == finish


def test_chat_history_renders_calls_and_results(app) -> None:
    """A call and its result in the history render in MiMo's spelling; thinking stays off by default."""
    app.say("It is sunny.<|im_end|>")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }
    messages = [
        {"role": "user", "content": family_checks.ASK},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {
        "model": "x",
        "messages": messages,
        "max_tokens": 64,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": family_checks.CITY}}],
    }
    response = app.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "It is sunny."
    prompt = app.last_prompt() or ""
    assert (
        "<|im_start|>assistant\n<think></think><tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
        "<parameter=days>3</parameter>\n</function>\n</tool_call><|im_end|>"
    ) in prompt
    assert prompt.endswith(
        "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|><|im_start|>assistant\n<think></think>"
    )
