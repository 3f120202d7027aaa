"""The minimax_m3 family (MiniMax M3 text: block-sparse attention through a Lightning indexer,
SwiGLU-OAI MLPs, sigmoid-routed MoE with shared experts): tiny checkpoints exported with the
minimax_m3 recipe, checked against transformers' own MiniMaxM3VLForCausalLM (eager) on prompts
spanning many more blocks than the indexer keeps, through run_prompt and the engine; the extra
indexer-key cache in the KV pool; MiniMax's own multimodal weight layout; refused variants; and
the published template with the minimax_m3 reasoning and tool parsers over Chat Completions,
Anthropic Messages and Responses."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from support import TinyCores

from helios.core import Core
from helios.core.manifest import KvLayout
from helios.core.program import SCORED_PREFILL, allocate_kv, run_prompt
from helios.engine import EngineConfig, build_engine
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family_of_hf_config, minimax_m3
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import TEXTS, check_batching_invariance, check_generation_matches, hf_logprobs

# The default tiny config (blocks of 4 keys, 3 kept with 1 local, 2 indexer heads = KV heads,
# 16-token pages), and one whose single indexer head serves both KV groups, with blocks of 8
# across 4-token pages, two local blocks of two kept, an indexer narrower than the rotary
# width (transformers truncates cos/sin to it) and tied embeddings.
VARIANTS: dict[str, tuple[dict[str, object], int]] = {
    "default": ({}, 16),
    "wide": (
        {
            "index_n_heads": 1,
            "index_block_size": 8,
            "index_topk_blocks": 2,
            "index_local_blocks": 2,
            "index_head_dim": 4,
            "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            "tie_word_embeddings": True,
        },
        4,
    ),
}
LONG = " ".join(TEXTS)  # ~150 tokens: dozens of blocks, far more than topk + local


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """(tiny checkpoint, its core with prompt logprobs, page tokens), once per variant."""
    changes, page = VARIANTS[request.param]
    checkpoint = family_checks.write_variant(
        "minimax_m3", tmp_path_factory.mktemp("ckpt") / f"tiny-minimax-{request.param}", changes, seed=3
    )
    core = tmp_path_factory.mktemp("cores") / f"tiny-minimax-{request.param}"
    export_core(
        open_source(str(checkpoint)),
        load_recipe("minimax_m3"),
        ExportOptions(out=core, prompt_logprobs=True, page_tokens=page),
    )
    return checkpoint, core, page


def _hf_model(checkpoint: Path, **overrides: object):
    return family_checks.hf_model(checkpoint, "MiniMaxM3VLForCausalLM", **overrides)


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_logprobs_match_transformers(exported: tuple[Path, Path, int]) -> None:
    checkpoint, core_dir, page = exported
    model = _hf_model(checkpoint)
    core = Core.open(core_dir)
    m = core.manifest
    config = minimax_m3.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("minimax_m3", "minimax_m3", page)
    assert m.kv.extra[0].layers == config.sparse_layer_ids and m.kv.extra[0].head_dim == config.index_head_dim
    assert {"block_select", "block_sparse_attention"} <= set(m.ops.ops)
    step, scored, weights = core.load_program(), core.load_program(SCORED_PREFILL), core.load_weights()
    tok = core.tokenizer()
    prompts = [tok.encode(text).ids for text in (TEXTS[1], TEXTS[0], LONG)]
    kept = config.index_topk_blocks * config.index_block_size
    assert len(prompts[-1]) > 4 * kept and len(prompts[-1]) > 4 * page  # selection drops most blocks
    worst = 0.0
    for ids in prompts:
        reference = hf_logprobs(model, ids)
        got = run_prompt(step, weights, m.kv, page, ids, chunk=16).logprobs
        worst = max(worst, float((got - reference).abs().max()))
        decoded = min(len(ids), kept + 2 * page + 3)  # token-by-token decode past several blocks and pages
        got = run_prompt(step, weights, m.kv, page, ids[:decoded], chunk=1).logprobs
        worst = max(worst, float((got - reference[:decoded]).abs().max()))
        run = run_prompt(scored, weights, m.kv, page, ids, chunk=16)
        expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        worst = max(worst, float((run.outputs["prompt_logprobs"][:-1] - expected).abs().max()))
        ranks = (reference[:-1] > expected[:, None]).sum(-1) + 1
        assert torch.equal(run.outputs["prompt_ranks"][:-1], ranks)
    print(f"max |Δ logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3, worst
    # The block selection matters on the long prompt: attending to every block gives other logprobs.
    dense = _hf_model(checkpoint, index_topk_blocks=10_000)
    assert float((hf_logprobs(dense, prompts[-1]) - hf_logprobs(model, prompts[-1])).abs().max()) > 1e-2


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_engine_generation_matches_transformers(exported: tuple[Path, Path, int]) -> None:
    """Greedy tokens' logprobs and top alternatives through the engine (16-token prefill chunks,
    then decode rows) equal transformers' on the whole sequence, for three prompts."""
    model = _hf_model(exported[0])
    for text in (TEXTS[1], TEXTS[2], LONG):
        check_generation_matches(exported[1], model, text, max_tokens=8)


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_engine_batching_invariance(exported: tuple[Path, Path, int]) -> None:
    texts = [
        TEXTS[0],
        TEXTS[1],
        TEXTS[2],
        TEXTS[3],
        LONG,
        "Water boils at",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        "My name",
    ]
    check_batching_invariance(exported[1], texts)


@pytest.mark.sampled  # one variant in CI, all with FLARE_SLOW_TESTS=1
def test_kv_pool_holds_the_indexer_keys(exported: tuple[Path, Path, int]) -> None:
    """One [pages, page_tokens, 1, index_head_dim] tensor per sparse layer after the K/V pairs,
    counted in the page size the pool is sized by."""
    core_dir, page = exported[1], exported[2]
    core = Core.open(core_dir)
    kv = core.manifest.kv
    sparse = kv.extra[0].layers
    assert kv.num_caches == 2 * kv.num_layers + len(sparse)
    per_page = page * (2 * kv.num_layers * kv.num_kv_heads * kv.head_dim + len(sparse) * kv.extra[0].head_dim) * 4
    engine = build_engine(core, EngineConfig(kv_memory_bytes=10 * per_page))
    assert engine.stats.total_pages == 10
    caches = engine.executor.kv
    assert [tuple(t.shape) for t in caches[2 * kv.num_layers :]] == [(10, page, 1, kv.extra[0].head_dim)] * len(sparse)
    assert len(allocate_kv(msgspec.structs.replace(kv, extra=()), 2, page)) == 2 * kv.num_layers


def test_old_manifest_without_extra_caches_loads() -> None:
    kv = msgspec.json.decode(b'{"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}', type=KvLayout)
    assert kv.extra == () and kv.num_caches == 4 and kv.token_elements == 4 * 2 * 16


def _minimax_layout(tensors: dict[str, torch.Tensor], config: minimax_m3.MiniMaxM3Config) -> dict[str, torch.Tensor]:
    """transformers' text names -> MiniMax's own multimodal checkpoint names (what conversion_mapping
    "minimax_m3_vl" undoes): language_model. prefixes, block_sparse_moe with per-expert w1/w3/w2,
    index_* indexer modules, separate gate/up projections."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = "language_model." + name
        if ".mlp." in name and (config.moe_layers[int(name.split(".")[3])]):
            name = name.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
            name = name.replace(".mlp.", ".block_sparse_moe.")
        name = name.replace(".self_attn.indexer.", ".self_attn.index_")
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                (
                    out[name.replace("gate_up_proj", f"{e}.w1.weight")],
                    out[name.replace("gate_up_proj", f"{e}.w3.weight")],
                ) = gate, up
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.w2.weight")] = t[e]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = t
    return out


def test_minimax_multimodal_layout_reads_the_same_model(tmp_path: Path) -> None:
    """A MiniMax-M3 checkpoint as MiniMax ships it (config under text_config, text weights behind
    language_model., experts per expert): same config, reference and internal weights as the
    text layout; vision tensors are refused by name."""
    checkpoint = open_source(str(write_testmodel("minimax_m3", tmp_path / "ckpt", seed=2)))
    hf = checkpoint.hf_config
    nested = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": hf,
        "vision_config": {"hidden_size": 32},
    }
    assert family_of_hf_config(nested) == "minimax_m3" and family_of_hf_config(hf) == "minimax_m3"
    config = minimax_m3.config_from_hf(nested)
    assert config == minimax_m3.config_from_hf(hf)
    original = _minimax_layout(checkpoint.tensors, config)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight" in original
    assert "language_model.model.layers.0.self_attn.index_q_proj.weight" in original
    ids = list(range(3, 40))
    assert torch.equal(
        minimax_m3.reference_logits(config, original, ids), minimax_m3.reference_logits(config, checkpoint.tensors, ids)
    )
    from dataclasses import replace

    plain = internal_weights(minimax_m3.FAMILY, checkpoint, config, torch.float32)
    renamed = internal_weights(minimax_m3.FAMILY, replace(checkpoint, tensors=original), config, torch.float32)
    assert renamed.keys() == plain.keys() and all(torch.equal(renamed[n], plain[n]) for n in plain)
    transformers_mm = {
        ("model.language_model." + n[len("model.") :] if n.startswith("model.") else n): t
        for n, t in checkpoint.tensors.items()
    }
    again = internal_weights(minimax_m3.FAMILY, replace(checkpoint, tensors=transformers_mm), config, torch.float32)
    assert again.keys() == plain.keys()
    vision = dict(original, **{"vision_tower.vision_model.embeddings.patch_embedding.weight": torch.zeros(2, 2)})
    with pytest.raises(SourceError, match="vision_tower.vision_model.embeddings.patch_embedding.weight"):
        internal_weights(minimax_m3.FAMILY, replace(checkpoint, tensors=vision), config, torch.float32)
    mtp = dict(original, **{"mtp.0.enorm.weight": torch.zeros(2)})  # multi-token prediction: not implemented
    with pytest.raises(SourceError, match="mtp.0.enorm.weight"):
        internal_weights(minimax_m3.FAMILY, replace(checkpoint, tensors=mtp), config, torch.float32)


def test_legacy_sparse_attention_config_reads_the_same_layers() -> None:
    config = minimax_m3.testmodel_config(300)
    legacy = {
        k: v for k, v in config.items() if not k.startswith("index_") and k not in ("layer_types", "mlp_layer_types")
    }
    legacy |= {
        "moe_layer_freq": [0, 1, 1],
        "sparse_attention_config": {
            "sparse_attention_freq": [1, 0, 1],
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": 4,
            "sparse_topk_blocks": 3,
            "sparse_local_block": 1,
        },
    }
    assert minimax_m3.config_from_hf(legacy) == minimax_m3.config_from_hf(config)


@pytest.mark.parametrize(
    "change",
    [
        {"layer_types": ["sliding_attention", "full_attention", "minimax_m3_sparse"]},
        {"mlp_layer_types": ["dense", "sparse"]},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        {"rotary_dim": 16},
        {"index_n_heads": 3},
        {"index_local_blocks": 4},
        {"swiglu_limit": 0.0},
        {"shared_intermediate_size": 0},
        {"quantization_config": {"quant_method": "fp8"}},
    ],
)
def test_unsupported_variants_are_refused(change: dict[str, object]) -> None:
    field = next(iter(change)) if "rope_parameters" not in change else "rope_type"
    with pytest.raises(ValueError, match=field):
        minimax_m3.config_from_hf(minimax_m3.testmodel_config(300) | change)


# ---------------------------------------------------------------------------- chat round trips

NS = "]<]minimax[>["
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
MINIMAX_OUTPUT = (
    f"<mm:think>The user wants weather.</mm:think>Checking.{NS}<tool_call>\n"
    f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>\n'
    f"{NS}</tool_call>[e~["
)
CALL = ("get_weather", {"city": "Paris", "days": 3})


@pytest.fixture(scope="module")
def chat_core(tiny_cores: TinyCores) -> Path:
    return family_checks.export_tiny("minimax_m3", "minimax_m3", tiny_cores, seed=6, prompt_logprobs=False)[1]


def _check_prompt(prompt: str | None) -> None:
    assert prompt is not None and prompt.startswith("]~!b[]~b]system\n") and prompt.endswith("]~b]ai\n")
    assert '<tool>{"name": "get_weather"' in prompt and "]~b]user\nWeather in Paris?[e~[" in prompt


def test_chat_completions_with_reasoning_and_tool_call(chat_core: Path) -> None:
    from server.scripted import scripted_app

    with scripted_app(chat_core) as app:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
        asked = [{"role": "user", "content": "Weather in Paris?"}]
        body = {"model": "x", "messages": asked, "tools": tools, "max_tokens": 256}
        reply, prompt = family_checks.scripted_turn(app, "/v1/chat/completions", body, MINIMAX_OUTPUT)
        _check_prompt(prompt)
        choice = reply["choices"][0]
        message = choice["message"]
        assert message["reasoning_content"] == "The user wants weather."
        assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        assert calls == [CALL]
        # The call and its result go back through the template as MiniMax's XML and <response>.
        history = body["messages"] + [
            {"role": "assistant", "content": "Checking.", "tool_calls": message["tool_calls"]},
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"},
        ]
        again, prompt = family_checks.scripted_turn(
            app, "/v1/chat/completions", dict(body, messages=history), "</mm:think>Sunny.[e~["
        )
        assert again["choices"][0]["message"]["content"] == "Sunny."
    assert f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>' in prompt
    assert "]~b]tool\n<response>sunny</response>[e~[" in prompt


def test_anthropic_messages_with_reasoning_and_tool_call(chat_core: Path) -> None:
    from server.scripted import scripted_app

    with scripted_app(chat_core) as app:
        app.say(MINIMAX_OUTPUT)
        body = {
            "model": "claude-x",
            "max_tokens": 256,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}],
        }
        response = app.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert response.status_code == 200, response.text
        _check_prompt(app.last_prompt())
    message = response.json()
    blocks = [(b["type"], b.get("thinking") or b.get("text") or (b["name"], b["input"])) for b in message["content"]]
    assert blocks == [("thinking", "The user wants weather."), ("text", "Checking."), ("tool_use", CALL)]
    assert message["stop_reason"] == "tool_use"


def test_responses_with_reasoning_and_tool_call(chat_core: Path) -> None:
    from server.scripted import scripted_app

    with scripted_app(chat_core) as app:
        app.say(MINIMAX_OUTPUT)
        body = {
            "model": "codex-x",
            "input": "Weather in Paris?",
            "max_output_tokens": 256,
            "store": False,
            "tools": [
                {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}
            ],
        }
        response = app.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        _check_prompt(app.last_prompt())
    out = response.json()
    items = []
    for item in out["output"]:
        if item["type"] == "function_call":
            items.append(("function_call", (item["name"], json.loads(item["arguments"]))))
        else:
            items.append((item["type"], item["content"][0]["text"]))
    assert items == [("reasoning", "The user wants weather."), ("message", "Checking."), ("function_call", CALL)]
    assert out["status"] == "completed"
