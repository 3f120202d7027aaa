"""The Gemma 4 text family: a tiny checkpoint (window 8 < 16-token pages, sliding and full layers
of different head sizes, attention_k_eq_v, per-layer inputs, two KV-shared layers with a
double-wide MLP, final soft-capping) exported with the gemma4 recipe and checked against
transformers' own Gemma4ForCausalLM (eager attention), through run_prompt and the engine; and
the MoE-block variant's reference and exported program against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.program import run_prompt
from ignition.export import ExportOptions, export_core
from ignition.models import gemma4
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition import family_checks, test_gemma3
from tests.ignition.family_checks import TEXTS, hf_logprobs

PAGE = 16
# (tiny Gemma 4 checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("gemma4", "gemma4", "Gemma4ForCausalLM")


_prompts = test_gemma3._prompts  # a chat through the template, with Gemma 3's special tokens, and a long text


def test_config_reads_the_gemma4_layout(tiny: tuple[Path, Path]) -> None:
    config = gemma4.FAMILY.config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    assert config.layer_windows == (8, 0, 8, 0)
    assert (config.layer_head_dims, config.layer_kv_heads) == ((16, 32, 16, 32), (2, 1, 2, 1))
    assert config.kv_sources == (0, 1, 0, 1) and gemma4.FAMILY.kv_shape(config) == (2, 2, 32)
    assert config.layer_intermediate == (96, 96, 192, 192)
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("gemma4", "gemma4", 16)
    assert (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (2, 2, 32)


@pytest.mark.parametrize(
    "change",
    [
        {"use_bidirectional_attention": "all"},
        {"attention_bias": True},
        {"hidden_activation": "silu"},
        {"num_kv_shared_layers": 3},
        {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
        # multimodal checkpoints are read (test_gemma4_vision.py, image tokens
        # attending both ways too), but not with text attending forwards
        {"model_type": "gemma4", "text_config": {"use_bidirectional_attention": "all"}, "vision_config": {}},
    ],
)
def test_unsupported_variants_are_refused(tiny: tuple[Path, Path], change: dict) -> None:
    config = json.loads((tiny[0] / "config.json").read_text()) | change
    with pytest.raises(ValueError):
        gemma4.FAMILY.config_from_hf(config)


# Gemma 3's checks of the programs (whole, chunked, token by token; prompt logprobs), run on this core.
test_logprobs_match_transformers = test_gemma3.test_logprobs_match_transformers


def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Decode rows (KV-shared layers reading their producers' pages) equal transformers on the whole sequence."""
    family_checks.check_generation_matches(tiny[1], reference, TEXTS[0], 16)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """Several prompts together (mixed prefill and windowed decode rows) == each alone, also from cached prefixes."""
    family_checks.check_batching_invariance(tiny[1], TEXTS)


MOE = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
}


def test_moe_variant_matches_transformers(tmp_path: Path) -> None:
    """The MoE block (router, GeLU experts beside the dense MLP), with v_proj and no KV sharing or PLE."""
    from safetensors.torch import save_file

    checkpoint = write_testmodel("gemma4", tmp_path / "ckpt", seed=5)
    config = json.loads((checkpoint / "config.json").read_text()) | MOE
    (checkpoint / "config.json").write_text(json.dumps(config))
    parsed = gemma4.FAMILY.config_from_hf(config)
    generator = torch.Generator().manual_seed(5)
    tensors = {
        n: (1.0 + 0.1 * torch.randn(s, generator=generator))
        if len(s) == 1
        else torch.randn(s, generator=generator) / s[-1] ** 0.5
        for n, s in gemma4.hf_shapes(parsed).items()
    }
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    model = family_checks.hf_model(checkpoint, "Gemma4ForCausalLM")
    ids = list(range(7, 47))
    ours = torch.log_softmax(gemma4.reference_logits(parsed, open_source(str(checkpoint)).tensors, ids), dim=-1)
    assert float((ours - hf_logprobs(model, ids)).abs().max()) <= 1e-4
    result = export_core(open_source(str(checkpoint)), load_recipe("gemma4"), ExportOptions(out=tmp_path / "core"))
    assert result.max_abs_diff <= 1e-3  # the self-check ran the program against that reference
    core = Core.open(tmp_path / "core")
    got = run_prompt(core.load_program(), core.load_weights(), core.manifest.kv, 16, ids, chunk=16).logprobs
    assert float((got - hf_logprobs(model, ids)).abs().max()) <= 1e-3
