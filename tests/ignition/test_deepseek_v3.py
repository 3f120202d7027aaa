"""The kimi_k3 family (DeepSeek-V3 architecture: MLA over a latent paged cache, routed MoE):
tiny checkpoints exported with the kimi3 recipe, checked against transformers' own
DeepseekV3ForCausalLM, the helios engine's batching invariance, and the one-tensor-per-layer KV pool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch
from support import TinyCores

from helios.core import Core
from helios.core.manifest import KvLayout
from helios.core.program import allocate_kv
from helios.engine import EngineConfig, build_engine
from helios.engine.sampling_params import SamplingParams
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import deepseek_v3, family_of_hf_config
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
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
        "rope_parameters": family_checks.MLA_YARN,
    },
}
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Kimi reads the latent cache: one row per token, shared by every head, keys and values alike.",
)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny checkpoint, its core with prompt logprobs), once per variant for this module."""
    name = request.param
    checkpoint = family_checks.write_variant(
        "kimi_k3", tmp_path_factory.mktemp("ckpt") / f"tiny-kimi-{name}", VARIANTS[name], seed=5
    )
    core = tmp_path_factory.mktemp("cores") / f"tiny-kimi-{name}"
    options = ExportOptions(out=core, prompt_logprobs=True, page_tokens=PAGE_TOKENS)
    export_core(open_source(str(checkpoint)), load_recipe("kimi3"), options)
    return checkpoint, core


def test_logprobs_match_transformers(exported: tuple[Path, Path]) -> None:
    checkpoint, core_dir = exported
    model = family_checks.hf_model(checkpoint, "DeepseekV3ForCausalLM", eager=False)
    core = Core.open(core_dir)
    m = core.manifest
    assert m.model.family == "kimi_k3" and m.recipe.name == "kimi3"
    assert m.kv.shared_kv and m.kv.num_kv_heads == 1 and m.kv.head_dim == 32 + 8  # kv_lora_rank + qk_rope_head_dim
    prompts = [core.tokenizer().encode(text, add_special_tokens=False).ids for text in TEXTS]
    assert max(len(p) for p in prompts) > PAGE_TOKENS  # one prompt spans pages
    # page-sized chunks, then token by token past the first page; and the scored prefill's prompt logprobs
    worst = family_checks.step_logprob_error(core_dir, model, prompts, PAGE_TOKENS + 4, chunks=(PAGE_TOKENS,))
    worst = max(worst, family_checks.prompt_logprob_error(core_dir, model, prompts, chunk=PAGE_TOKENS))
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
    config = deepseek_v3.FAMILY.config_from_hf(checkpoint.hf_config)
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
    config = deepseek_v3.FAMILY.config_from_hf(nested)
    assert config == deepseek_v3.FAMILY.config_from_hf(hf)
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
        deepseek_v3.FAMILY.config_from_hf(config)


# ---------------------------------------------------------------------------- chat round trip

O, C, S = "<|open|>", "<|close|>", "<|sep|>"
KIMI_OUTPUT = (
    f"The user wants weather.{C}think{S}{O}response{S}Checking.{C}response{S}{O}tools{S}"
    f'{O}call tool="get_weather" index="1"{S}{O}argument key="city" type="string"{S}Paris{C}argument{S}'
    f'{O}argument key="days" type="number"{S}3{C}argument{S}{C}call{S}{C}tools{S}{C}message{S}<|end_of_msg|>'
)


@pytest.fixture(scope="module")
def chat_core(tiny_cores: TinyCores) -> Path:
    return family_checks.export_tiny("kimi_k3", "kimi3", tiny_cores, seed=6, prompt_logprobs=False)[1]


def test_chat_completion_with_reasoning_and_tool_call(chat_core: Path) -> None:
    """Kimi K3's published template renders the request; a scripted model's K3 output comes back
    through the recipe's kimi3 reasoning and tool parsers as Chat Completions fields."""
    # tests/server's in-process server with a scripted model (tests/ is on sys.path)
    from server.scripted import scripted_app

    with scripted_app(chat_core) as app:
        app.say(KIMI_OUTPUT)
        got, finish = family_checks.tool_round_trip(app, "chat", family_checks.ASK, family_checks.CITY)
        prompt = app.last_prompt()
    assert prompt is not None and prompt.endswith(f'{O}message role="assistant"{S}{O}think{S}')
    assert '"get_weather"' in prompt and f'{O}message role="user"{S}Weather in Paris?' in prompt
    assert got == family_checks.WEATHER_CALL and finish == "tool_calls"
