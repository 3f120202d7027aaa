"""The glm_moe_dsa family (GLM-5: MLA + DeepSeek Sparse Attention + routed MoE): tiny checkpoints
exported with a GLM-5 test recipe (tests/data/tiny_glm5.toml: glm53's template and parsers) and
checked against transformers' own GlmMoeDsaForCausalLM,
with prompts longer than index_topk (the indexer drops keys) and than a KV page; the engine's
batching invariance over a pool of latent + indexer-key tensors; the GLM-5.3-Flash template and
the glm / glm47 parsers through Chat Completions, Messages and Responses; refused variants."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from helios.core import Core
from helios.core.manifest import KvLayout
from helios.core.program import allocate_kv
from helios.engine import EngineConfig, build_engine
from ignition.export import ExportOptions, export_core
from ignition.models import glm_moe_dsa
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition import family_checks
from tests.ignition.family_checks import (
    ASK,
    CITY,
    LONG_PREAMBLE,
    SHORT_TEXTS,
    TEXTS,
    WEATHER_CALL,
    check_generation_matches,
    hf_logprobs,
)

PAGE_TOKENS = 16
# GLM-5's presets for this family's cores (the shipped glm53 recipe names glm5_next, GLM-5.3-Flash's architecture).
GLM5_RECIPE = Path(__file__).parents[1] / "data" / "tiny_glm5.toml"
TOPK = 8  # testmodel_config's index_topk
# The default tiny config (indexer full / shared / full, plain rotary, one expert group), and one
# with YaRN (mscale != mscale_all_dim), tied embeddings, two expert groups, every layer dense
# but the last, and the indexer schedule from index_topk_freq / index_skip_topk_offset.
VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "yarn_tied_groups": {
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "n_group": 2,
        "topk_group": 1,
        "mlp_layer_types": ["dense", "dense", "sparse"],
        "indexer_types": None,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 2,
        "index_topk": 6,
        "rope_parameters": family_checks.MLA_YARN,
    },
}
PROMPTS = (
    "The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "GLM reads the latent cache through its indexer: each query keeps only the keys it scores highest.",
)


def _export(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny checkpoint of a variant, its core); the default variant's core has prompt logprobs."""
    changes = VARIANTS[name]
    dropped = [k for k, v in changes.items() if v is None]  # a None field is left out
    checkpoint = family_checks.write_variant(
        "glm_moe_dsa", tmp_path_factory.mktemp("ckpt") / f"tiny-glm-{name}", changes, 5, dropped
    )
    core = tmp_path_factory.mktemp("cores") / f"tiny-glm-{name}"
    options = ExportOptions(out=core, prompt_logprobs=name == "default", page_tokens=PAGE_TOKENS)
    export_core(open_source(str(checkpoint)), load_recipe(str(GLM5_RECIPE)), options)
    return checkpoint, core


@pytest.fixture(scope="module")
def default_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _export("default", tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    name = request.param
    checkpoint, core = request.getfixturevalue("default_core") if name == "default" else _export(name, tmp_path_factory)
    return name, checkpoint, core


@pytest.fixture
def tie_watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Compares, row by row, transformers' indexer top-k with the ops' selection rule applied to
    transformers' own scores. They can differ only where an exact tie sits at the k-th score:
    torch.topk has no fixed order among ties (its choice changes with the row's length), while the
    ops keep the earlier key (tests/engine/test_kernels_sparse.py). Counts rows that drop keys,
    rows with such a tie, and rows whose kept keys differ (family_checks.watch_topk_ties)."""

    def index_scores(scores: torch.Tensor, k: int, dim: int) -> bool:  # [B, S, T]
        return scores.dim() == 3 and dim == -1 and scores.is_floating_point() and k > 2

    return family_checks.watch_topk_ties(monkeypatch, index_scores)


def _hf_model(checkpoint: Path, **overrides: object):
    return family_checks.hf_model(checkpoint, "GlmMoeDsaForCausalLM", eager=False, **overrides)


def test_logprobs_match_transformers(exported: tuple[str, Path, Path], tie_watch: dict[str, int]) -> None:
    """Prefill in page-sized chunks, token-by-token decode past the first page and past index_topk,
    and scored prefill, against transformers' full forward on each prompt."""
    name, checkpoint, core_dir = exported
    model = _hf_model(checkpoint)
    core = Core.open(core_dir)
    m = core.manifest
    config = glm_moe_dsa.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    assert m.model.family == "glm_moe_dsa" and m.recipe.name == "tiny_glm5"
    assert m.kv.shared_kv and (m.kv.num_kv_heads, m.kv.head_dim) == (1, 32 + 8)  # kv_lora_rank + qk_rope_head_dim
    assert [(e.name, e.layers, e.num_heads, e.head_dim) for e in m.kv.extra] == [
        ("indexer_k", tuple(config.indexer_layers), 1, 16)
    ]
    prompts = [core.tokenizer().encode(text, add_special_tokens=False).ids for text in PROMPTS]
    assert min(len(p) for p in prompts) > PAGE_TOKENS + 4 > config.index_topk  # selection drops keys
    # page-sized chunks, then token by token past the first page (and past index_topk); the scored prefill
    worst = family_checks.step_logprob_error(core_dir, model, prompts, PAGE_TOKENS + 4, chunks=(PAGE_TOKENS,))
    if m.capabilities.prompt_logprobs:
        worst = max(worst, family_checks.prompt_logprob_error(core_dir, model, prompts, chunk=PAGE_TOKENS))
    print(f"{name}: max |Δ logprob| vs transformers: {worst:.3g}; transformers' indexer rows: {tie_watch}")
    assert worst <= 1e-3, worst
    assert tie_watch["dropping"] > 0 and tie_watch["differ"] == 0, tie_watch
    # The selection matters: with every key kept, transformers' own model answers differently.
    dense = hf_logprobs(_hf_model(checkpoint, index_topk=4096), prompts[0])
    assert float((dense - hf_logprobs(model, prompts[0])).abs().max()) > 1e-2


def test_reference_matches_transformers(exported: tuple[str, Path, Path]) -> None:
    """The export self-check's dense reference (stable-sort selection, non-absorbed MLA) itself."""
    _, checkpoint, _ = exported
    assert family_checks.reference_error("glm_moe_dsa", checkpoint, _hf_model(checkpoint), list(range(5, 45))) <= 1e-4


def test_engine_generation_matches_transformers(default_core: tuple[Path, Path], tie_watch: dict[str, int]) -> None:
    """Greedy tokens' logprobs and top alternatives through the engine (16-token prefill chunks,
    then decode rows whose attention reads only the selected latent rows) on three prompts:
    two longer than index_topk and a page, one shorter than index_topk (every key kept)."""
    checkpoint, core_dir = default_core
    model = _hf_model(checkpoint)
    for text in (PROMPTS[0], TEXTS[1], TEXTS[3]):
        check_generation_matches(core_dir, model, text, 12)
    print(f"transformers' indexer rows: {tie_watch}")
    assert tie_watch["dropping"] > 0 and tie_watch["differ"] == 0, tie_watch


def test_engine_batching_invariance_and_pool(default_core: tuple[Path, Path]) -> None:
    """8 prompts together == each alone (prefix cache on and off, 16-token prefill chunks), over a
    pool of one latent tensor per layer plus one indexer-key tensor per full indexer layer."""
    core = Core.open(default_core[1])
    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    kv = core.manifest.kv
    assert [tuple(t.shape) for t in solo.executor.kv] == [(128, PAGE_TOKENS, 1, 40)] * 3 + [
        (128, PAGE_TOKENS, 1, 16)
    ] * 2
    family_checks.check_eight_prompts_batching(
        default_core[1], LONG_PREAMBLE, SHORT_TEXTS, ({}, {"enable_prefix_cache": False}, {"prefill_chunk_size": 16})
    )
    # A page holds every tensor's rows: 3 latents of 40 and 2 indexer keys of 16, fp32.
    per_page = PAGE_TOKENS * (3 * 40 + 2 * 16) * 4
    assert build_engine(core, EngineConfig(kv_memory_bytes=10 * per_page)).stats.total_pages == 10
    assert len(allocate_kv(kv, 2, PAGE_TOKENS)) == kv.num_caches == 5


def test_manifest_without_extra_caches_loads() -> None:
    """Cores written before KvLayout.extra existed decode with no extra tensors."""
    kv = msgspec.json.decode(
        b'{"num_layers": 2, "num_kv_heads": 1, "head_dim": 16, "dtype": "float32", "shared_kv": true}', type=KvLayout
    )
    assert kv.extra == () and kv.num_caches == 2 and kv.cache_shapes() == ((1, 16), (1, 16))


BASE = glm_moe_dsa.testmodel_config(300)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]}, "glm5_next"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"indexer_types": ["shared", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full", "full"]}, "indexer_types"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"index_head_dim": 4}, "index_head_dim"),
    ],
)
def test_unsupported_variants_are_refused(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        glm_moe_dsa.config_from_hf(BASE | change)


def test_indexer_schedule_follows_transformers() -> None:
    from transformers import GlmMoeDsaConfig

    for extra in ({}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}, {"index_topk_pattern": "FSF"}):
        hf = {k: v for k, v in BASE.items() if k != "indexer_types"} | extra
        expected = GlmMoeDsaConfig(**hf).indexer_types
        assert list(glm_moe_dsa.config_from_hf(hf).indexer_types) == expected, extra


# ---------------------------------------------------------------------------- chat round trip

GLM_OUTPUT = (
    "The user wants weather.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)

app = family_checks.served("default_core")


def _check_prompt(prompt: str | None, effort: str = "Max") -> None:
    assert prompt is not None and prompt.startswith(f"[gMASK]<sop><|system|>Reasoning Effort: {effort}")
    assert prompt.endswith(f"<|user|>{ASK}<|assistant|><think>") and '"name": "get_weather"' in prompt


def test_chat_completion_with_reasoning_and_tool_call(app) -> None:
    """GLM-5.3-Flash's published template renders the request (default effort max); the scripted
    model's GLM output comes back through the recipe's glm reasoning and glm47 tool parsers."""
    app.say(GLM_OUTPUT)
    got, finish = family_checks.tool_round_trip(app, "chat", ASK, CITY)
    _check_prompt(app.last_prompt())
    assert got == WEATHER_CALL and finish == "tool_calls"
    # Effort "none" is the template's own switch: no effort line, and an empty think block pre-filled.
    app.say("Paris.")
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 256,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        "reasoning_effort": "none",
    }
    response = app.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Paris."
    prompt = app.last_prompt() or ""
    assert "Reasoning Effort" not in prompt and prompt.endswith(f"<|user|>{ASK}<|assistant|><think></think>")


def test_messages_with_reasoning_and_tool_call(app) -> None:
    app.say(GLM_OUTPUT)
    got, finish = family_checks.tool_round_trip(app, "messages", ASK, CITY)
    _check_prompt(app.last_prompt())
    assert got == WEATHER_CALL and finish == "tool_use"


def test_responses_with_reasoning_and_tool_call(app) -> None:
    app.say(GLM_OUTPUT)
    got, finish = family_checks.tool_round_trip(app, "responses", ASK, CITY, reasoning={"effort": "low"})
    _check_prompt(app.last_prompt(), effort="Low")
    assert got == WEATHER_CALL and finish == "completed"
