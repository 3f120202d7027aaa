"""The kimi_k3 family (DeepSeek-V3 architecture: MLA over a latent paged cache, routed MoE):
tiny checkpoints exported with the kimi3 recipe, checked against transformers' own
DeepseekV3ForCausalLM, the helios engine's batching invariance, and the one-tensor-per-layer KV pool."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from helios.core import Core
from helios.core.manifest import KvLayout
from helios.core.program import SCORED_PREFILL, allocate_kv, run_prompt
from helios.engine import EngineConfig, build_engine
from helios.engine.sampling_params import SamplingParams
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import deepseek_v3, family_of_hf_config
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import _init, write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import LONG_PREAMBLE, SHORT_TEXTS

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
PAGE_TOKENS = 16
# Variants of the tiny config: the default (q LoRA, interleaved plain rotary), and no q LoRA with
# YaRN (mscale != mscale_all_dim, so cos/sin and the softmax scale both carry corrections) and
# rotate-half rotary.
VARIANTS: dict[str, dict[str, object]] = {
    "q_lora": {},
    "plain_q_yarn": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    },
}
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Kimi reads the latent cache: one row per token, shared by every head, keys and values alike.",
)


def write_variant(out: Path, changes: dict[str, object], seed: int) -> Path:
    """A tiny kimi_k3 checkpoint with `changes` applied to its config (tensors regenerated to fit)."""
    write_testmodel("kimi_k3", out, seed=seed)
    if not changes:
        return out
    config = json.loads((out / "config.json").read_text()) | changes
    generator = torch.Generator().manual_seed(seed)
    shapes = deepseek_v3.hf_shapes(deepseek_v3.config_from_hf(config))
    save_file(
        {n: _init(n, s, generator) for n, s in shapes.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny checkpoint, its core with prompt logprobs), once per variant for this module."""
    name = request.param
    checkpoint = write_variant(tmp_path_factory.mktemp("ckpt") / f"tiny-kimi-{name}", VARIANTS[name], seed=5)
    core = tmp_path_factory.mktemp("cores") / f"tiny-kimi-{name}"
    options = ExportOptions(out=core, prompt_logprobs=True, page_tokens=PAGE_TOKENS)
    export_core(open_source(str(checkpoint)), load_recipe("kimi3"), options)
    return checkpoint, core


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_match_transformers(exported: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint, core_dir = exported
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    core = Core.open(core_dir)
    m = core.manifest
    assert m.model.family == "kimi_k3" and m.recipe.name == "kimi3"
    assert m.kv.shared_kv and m.kv.num_kv_heads == 1 and m.kv.head_dim == 32 + 8  # kv_lora_rank + qk_rope_head_dim
    step, scored, weights = core.load_program(), core.load_program(SCORED_PREFILL), core.load_weights()
    tokenizer = core.tokenizer()
    prompts = [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]
    assert max(len(p) for p in prompts) > PAGE_TOKENS  # one prompt spans pages
    worst = 0.0
    for ids in prompts:
        reference = _hf_logprobs(model, ids)
        got = run_prompt(step, weights, m.kv, PAGE_TOKENS, ids, chunk=PAGE_TOKENS).logprobs
        worst = max(worst, float((got - reference).abs().max()))
        decoded = PAGE_TOKENS + 4  # token-by-token decode steps, past the first page
        got = run_prompt(step, weights, m.kv, PAGE_TOKENS, ids[:decoded], chunk=1).logprobs
        worst = max(worst, float((got - reference[:decoded]).abs().max()))
        run = run_prompt(scored, weights, m.kv, PAGE_TOKENS, ids, chunk=PAGE_TOKENS)
        expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        worst = max(worst, float((run.outputs["prompt_logprobs"][:-1] - expected).abs().max()))
    print(f"max |Δ logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3, worst


def test_engine_batching_invariance_and_latent_pool(exported: tuple[Path, Path]) -> None:
    """8 prompts together == each alone (prefix cache on and off, 16-token prefill chunks), over a
    KV pool of one latent tensor per layer."""
    core = Core.open(exported[1])
    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    m = core.manifest
    assert len(solo.executor.kv) == m.kv.num_layers  # not 2 * num_layers: keys and values share the latent
    assert tuple(solo.executor.kv[0].shape) == (128, PAGE_TOKENS, 1, m.kv.head_dim)
    family_checks.check_eight_prompts_batching(
        exported[1], LONG_PREAMBLE, SHORT_TEXTS, ({}, {"enable_prefix_cache": False}, {"prefill_chunk_size": 16})
    )


def test_page_bytes_count_one_latent_per_layer(exported: tuple[Path, Path]) -> None:
    core = Core.open(exported[1])
    kv = core.manifest.kv
    per_page = kv.num_layers * PAGE_TOKENS * kv.head_dim * 4  # fp32, one tensor per layer
    engine = build_engine(core, EngineConfig(kv_memory_bytes=10 * per_page))
    assert engine.stats.total_pages == 10
    assert len(allocate_kv(kv, 2, PAGE_TOKENS)) == kv.num_layers
    assert len(allocate_kv(msgspec.structs.replace(kv, shared_kv=False), 2, PAGE_TOKENS)) == 2 * kv.num_layers


def test_old_manifest_without_shared_kv_loads() -> None:
    """Cores written before KvLayout.shared_kv existed decode with separate K and V tensors."""
    kv = msgspec.json.decode(b'{"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}', type=KvLayout)
    assert not kv.shared_kv and kv.num_caches == 4


def test_dense_and_moe_layers_fuse_their_own_groups(tmp_path: Path) -> None:
    checkpoint = open_source(str(write_testmodel("kimi_k3", tmp_path / "ckpt", seed=1)))
    config = deepseek_v3.config_from_hf(checkpoint.hf_config)
    weights = internal_weights(deepseek_v3.FAMILY, checkpoint, config, torch.float32)
    assert "layers.0.w_gate_up" in weights and "layers.0.w_shared_gate_up" not in weights  # dense layer
    assert "layers.1.w_shared_gate_up" in weights and "layers.1.w_gate_up" not in weights  # MoE layer
    assert weights["layers.1.w_experts_gate_up"].shape == (8, 64, 64)
    # A layer holding part of a fused group (gate without up) is still an error.
    checkpoint.tensors.pop("model.layers.2.mlp.shared_experts.up_proj.weight")
    with pytest.raises(SourceError, match="missing tensors"):
        internal_weights(deepseek_v3.FAMILY, checkpoint, config, torch.float32)


def test_kimi_k25_text_layout_reads_the_same_model(tmp_path: Path) -> None:
    """Kimi K2.5-style checkpoints: config nested under text_config, weights under language_model."""
    checkpoint = open_source(str(write_testmodel("kimi_k3", tmp_path / "ckpt", seed=2)))
    hf = checkpoint.hf_config
    nested = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": hf}
    assert family_of_hf_config(nested) == "kimi_k3"
    config = deepseek_v3.config_from_hf(nested)
    assert config == deepseek_v3.config_from_hf(hf)
    moonshot = {
        ("language_model." + n if n.startswith(("model.", "lm_head.")) else n): t for n, t in checkpoint.tensors.items()
    }
    ids = list(range(3, 30))
    same = deepseek_v3.reference_logits(config, moonshot, ids)
    assert torch.equal(same, deepseek_v3.reference_logits(config, checkpoint.tensors, ids))
    renamed = internal_weights(deepseek_v3.FAMILY, replace(checkpoint, tensors=moonshot), config, torch.float32)
    plain = internal_weights(deepseek_v3.FAMILY, checkpoint, config, torch.float32)
    assert renamed.keys() == plain.keys() and all(torch.equal(renamed[n], plain[n]) for n in plain)


@pytest.mark.parametrize(
    "change", [{"scoring_func": "softmax"}, {"hidden_act": "gelu"}, {"rope_scaling": {"type": "linear", "factor": 2.0}}]
)
def test_unsupported_variants_are_refused(change: dict[str, object]) -> None:
    config = deepseek_v3.testmodel_config(300) | change
    with pytest.raises(ValueError):
        deepseek_v3.config_from_hf(config)


# ---------------------------------------------------------------------------- chat round trip

O, C, S = "<|open|>", "<|close|>", "<|sep|>"
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
KIMI_OUTPUT = (
    f"The user wants weather.{C}think{S}{O}response{S}Checking.{C}response{S}{O}tools{S}"
    f'{O}call tool="get_weather" index="1"{S}{O}argument key="city" type="string"{S}Paris{C}argument{S}'
    f'{O}argument key="days" type="number"{S}3{C}argument{S}{C}call{S}{C}tools{S}{C}message{S}<|end_of_msg|>'
)


@pytest.fixture(scope="module")
def chat_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = write_testmodel("kimi_k3", tmp_path_factory.mktemp("ckpt") / "tiny-kimi-chat", seed=6)
    core = tmp_path_factory.mktemp("cores") / "tiny-kimi-chat"
    export_core(open_source(str(checkpoint)), load_recipe("kimi3"), ExportOptions(out=core))
    return core


def test_chat_completion_with_reasoning_and_tool_call(chat_core: Path) -> None:
    """Kimi K3's published template renders the request; a scripted model's K3 output comes back
    through the recipe's kimi3 reasoning and tool parsers as Chat Completions fields."""
    # tests/server's in-process server with a scripted model (tests/ is on sys.path)
    from server.scripted import scripted_app

    with scripted_app(chat_core) as app:
        app.say(KIMI_OUTPUT)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools,
            "max_tokens": 256,
        }
        response = app.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        prompt = app.last_prompt()
    assert prompt is not None and prompt.endswith(f'{O}message role="assistant"{S}{O}think{S}')
    assert '"get_weather"' in prompt and f'{O}message role="user"{S}Weather in Paris?' in prompt
    choice = response.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]
