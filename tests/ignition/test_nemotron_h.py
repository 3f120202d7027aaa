"""The nemotron_h family (NVIDIA Nemotron-H: Mamba-2 layers among attention, MLP and MoE layers):
a tiny checkpoint in NVIDIA's spellings (Mamba, MoE, attention, Mamba, MLP; 2 B/C groups; a
latent MoE with group-limited routing; one MTP layer) exported with the nemotron_h recipe and
checked against transformers' own NemotronHForCausalLM (its torch Mamba path, eager attention),
through run_prompt (whole prompts, 16- and 5-token chunks, token by token: the conv window
and SSM state carried in their slots) and the engine (prompts longer than a page and several
16-token chunks, batching invariance, prefix reuse through state snapshots); the published
template with the think / qwen3_coder parsers through Chat Completions, Messages and Responses;
refused variants."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helios.core import Core
from helios.core.program import run_prompt
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family_of_hf_config, nemotron_h
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import _tensor, write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import LONG_TEXT, TEXTS, hf_logprobs

PAGE = 16
# (tiny Nemotron-H checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("nemotron_h", "nemotron_h", "NemotronHForCausalLM")


def _prompts(core: Core) -> list[list[int]]:
    """A rendered chat (the published template), a long text and a short one."""
    return family_checks.chat_prompts(core, {"bos_token": "<s>", "eos_token": "<|im_end|>"}, LONG_TEXT, TEXTS[2])


def test_config_reads_the_hybrid_layout(tiny: tuple[Path, Path]) -> None:
    hf = json.loads((tiny[0] / "config.json").read_text())
    assert family_of_hf_config(hf) == "nemotron_h"
    c = nemotron_h.config_from_hf(hf)
    assert c.layer_types == ("linear_attention", "moe", "full_attention", "linear_attention", "mlp")
    assert (c.mamba_layers, c.n_groups, c.conv_dim, c.latent_size, c.dt_min) == ((0, 3), 2, 128, 32, 0.001)
    assert c.router is not None and (c.router.n_group, c.router.topk_group, c.router.routed_scaling_factor) == (
        2,
        1,
        2.5,
    )
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("nemotron_h", "nemotron_h", PAGE)
    assert (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (5, 2, 16)
    assert [(e.name, e.layers, e.shape, e.dtype) for e in m.kv.state] == [
        ("conv", (0, 3), (128, 3), "float32"),
        ("ssm", (0, 3), (8, 8, 16), "float32"),
    ]
    assert (m.recipe.reasoning_syntax, m.recipe.tool_syntax, m.recipe.template_source) == (
        "think",
        "qwen3_coder",
        "checkpoint",
    )
    assert "mamba2_scan" in m.ops.ops and "causal_conv1d" in m.ops.ops


def test_transformers_spellings_read_the_same_config(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers saves layers_block_type, n_groups, conv_kernel, time_step_min...: same model."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(tiny[0])).save_pretrained(str(tmp_path))
    native = json.loads((tmp_path / "config.json").read_text())
    assert "layers_block_type" in native and "hybrid_override_pattern" not in native and "mamba_n_groups" not in native
    ours = json.loads((tiny[0] / "config.json").read_text())
    assert nemotron_h.config_from_hf(native) == nemotron_h.config_from_hf(ours)
    legacy = {k: v for k, v in ours.items() if k != "hybrid_override_pattern"}
    legacy["layers_block_type"] = ["mamba", "moe", "attention", "mamba", "mlp"]  # transformers' legacy names
    assert nemotron_h.config_from_hf(legacy) == nemotron_h.config_from_hf(ours)


def test_other_layouts_read_the_same_weights(tiny: tuple[Path, Path], reference) -> None:
    """transformers' in-memory names (model., stacked experts.up_proj [E, F, latent]) read the same
    weights; the MTP layer's tensors are left out."""
    checkpoint = open_source(str(tiny[0]))
    config = nemotron_h.config_from_hf(checkpoint.hf_config)
    native = reference.state_dict()
    assert "model.layers.1.mixer.experts.up_proj" in native and any(n.startswith("mtp.") for n in checkpoint.tensors)
    plain = internal_weights(nemotron_h.FAMILY, checkpoint, config, torch.float32)
    renamed = internal_weights(nemotron_h.FAMILY, replace(checkpoint, tensors=native), config, torch.float32)
    assert renamed.keys() == plain.keys() and all(torch.equal(renamed[n], plain[n]) for n in plain)
    ids = list(range(3, 40))
    assert torch.equal(
        nemotron_h.reference_logits(config, native, ids), nemotron_h.reference_logits(config, checkpoint.tensors, ids)
    )


def test_reference_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """The self-check's float64 reference is transformers' model (so the export checks against it)."""
    assert family_checks.reference_error("nemotron_h", tiny[0], reference, list(range(5, 70))) <= 1e-4


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Prompts longer than a page, prefilled whole, in chunks of 16 and 5 (each chunk resumes the
    conv window and SSM state from its slot), and token by token past the first page; and their prompt logprobs."""
    prompts = _prompts(Core.open(tiny[1]))
    assert all(len(ids) > 3 * PAGE for ids in prompts[:2])
    family_checks.check_program_logprobs(tiny[1], reference, prompts)


@pytest.mark.parametrize("text", [LONG_TEXT, TEXTS[1], TEXTS[2]])
def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference, text: str) -> None:
    """The engine's greedy tokens (16-token prefill chunks, then decode rows whose state lives in
    slots) carry transformers' logprobs and top alternatives on the whole sequence."""
    family_checks.check_generation_matches(tiny[1], reference, text, 16)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """8 prompts together == each alone, prefix cache on and off, 16-token prefill chunks."""
    family_checks.check_eight_prompts_batching(tiny[1])


def test_prefix_reuse(tiny: tuple[Path, Path]) -> None:
    family_checks.check_prefix_reuse(tiny[1], LONG_TEXT)


def test_plain_variant_matches_transformers(tmp_path: Path) -> None:
    """transformers' own spellings and other branches: a layers_block_type list with attention
    first, no conv bias, experts at hidden size (no latent projections), one expert group, no
    renormalization, checkpoint names under model. with stacked experts (transformers' state dict)."""
    checkpoint = write_testmodel("nemotron_h", tmp_path / "ckpt", seed=5)
    config = json.loads((checkpoint / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("hybrid_override_pattern", "mamba_n_groups")}
    config |= {
        "layers_block_type": ["full_attention", "linear_attention", "moe", "linear_attention"],
        "num_hidden_layers": 4,
        "n_groups": 4,
        "use_conv_bias": False,
        "moe_latent_size": None,
        "n_group": 1,
        "norm_topk_prob": False,
    }
    (checkpoint / "config.json").write_text(json.dumps(config))
    parsed = nemotron_h.config_from_hf(config)
    generator = torch.Generator().manual_seed(5)
    tensors = {n: _tensor(nemotron_h.testmodel_init, n, s, generator) for n, s in nemotron_h.hf_shapes(parsed).items()}
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    model = family_checks.hf_model(checkpoint, "NemotronHForCausalLM")
    # The same weights under transformers' in-memory names (its save_pretrained writes NVIDIA's back).
    native = {n: t.contiguous() for n, t in model.state_dict().items()}
    save_file(native, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    source = open_source(str(checkpoint))
    assert "model.layers.2.mixer.experts.up_proj" in source.tensors
    ids = list(range(7, 47))
    expected = hf_logprobs(model, ids)
    ours = torch.log_softmax(nemotron_h.reference_logits(parsed, source.tensors, ids), dim=-1)
    assert float((ours - expected).abs().max()) <= 1e-4
    result = export_core(source, load_recipe("nemotron_h"), ExportOptions(out=tmp_path / "core"))
    assert result.max_abs_diff <= 1e-3  # the self-check ran the program against that reference
    core = Core.open(tmp_path / "core")
    for chunk in (PAGE, 3):
        got = run_prompt(core.load_program(), core.load_weights(), core.manifest.kv, PAGE, ids, chunk=chunk).logprobs
        assert float((got - expected).abs().max()) <= 1e-3


# (tokens, experts, top_k, width, dtype): the op's unsorted decode path, grouped matmuls, the loop fallback
EXPERT_CASES = {
    "decode": (1, 8, 2, 16, torch.float32),
    "batch": (24, 8, 2, 16, torch.float32),
    "unaligned": (24, 8, 2, 6, torch.float32),
    "bf16 batch": (24, 8, 2, 16, torch.bfloat16),
}


@pytest.mark.parametrize("case", sorted(EXPERT_CASES))
def test_relu2_experts_match_transformers(case: str) -> None:
    """flare::routed_experts with the ungated relu2 activation (stacks of up rows only), reference
    and helios kernel, against transformers' NemotronHExperts on the same weights and routing."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    from helios.core.ops.moe import reference_routed_experts
    from helios.engine.kernels.moe import routed_experts_cpu

    tokens, e, k, f, dtype = EXPERT_CASES[case]
    gen = torch.Generator().manual_seed(4)
    hidden = 32
    w_up, w_down = (
        torch.randn(e, f, hidden, generator=gen) / hidden**0.5,
        torch.randn(e, hidden, f, generator=gen) / f**0.5,
    )
    weights, ids = torch.randn(tokens, e, generator=gen).softmax(-1).topk(k, dim=-1)
    h = torch.randn(tokens, hidden, generator=gen)
    module = NemotronHExperts(NemotronHConfig(hidden_size=hidden, n_routed_experts=e, moe_intermediate_size=f))
    module.up_proj.data, module.down_proj.data = w_up.clone(), w_down.clone()
    with torch.no_grad():
        expected = module(h, ids, weights)
    args = (h.to(dtype), weights, ids, w_up.to(dtype), w_down.to(dtype), "relu2")
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for kernel in (reference_routed_experts, routed_experts_cpu):
        torch.testing.assert_close(kernel(*args), expected, rtol=tol, atol=tol)


BASE = nemotron_h.testmodel_config(300)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"use_bias": True}, "use_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"sliding_window": 64}, "sliding_window"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
        ({"layers_block_type": ["linear_attention", "sliding_attention"]}, "layers_block_type"),
        ({"hybrid_override_pattern": "*-E"}, "without a linear_attention"),
        ({"mamba_n_groups": 3}, "n_groups"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_unsupported_variants_are_refused(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        nemotron_h.config_from_hf(BASE | change)


# ---------------------------------------------------------------------------- chat round trips


app = family_checks.served("tiny")


def _check_prompt(app) -> None:
    prompt = app.last_prompt() or ""
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert "<function>\n<name>get_weather</name>" in prompt and "<function=example_function_name>" in prompt
    assert prompt.endswith(f"<|im_start|>user\n{family_checks.ASK}<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize(("route", "finish"), family_checks.TOOL_ROUTES)
def test_reasoning_and_tool_call(app, route: str, finish: str) -> None:
    """Nemotron's reasoning and call come back in each protocol's shape, from the published template's prompt."""
    family_checks.check_think_tool_call(app, route, finish, _check_prompt)
