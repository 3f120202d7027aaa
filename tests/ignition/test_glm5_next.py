"""The glm5_next family (GLM-5.3-Flash text: KDA linear attention + k-pool DSA over NoPE MLA under
hyper-connection streams, clamped-SwiGLU MoE): the two new ops against their references and
transformers' KDA functions; a tiny checkpoint exported with the glm53 recipe and checked against
transformers' own Glm5NextForConditionalGeneration (the programs prefilled whole, in 16-, 5- and
1-token chunks, prompt logprobs, engine generation; prompts longer than the indexer's kept
positions and than a page), batching invariance and prefix reuse over the state slots, refused
variants, and the recipe's template and glm / glm47 parsers through Chat Completions, Messages and
Responses (images refused: the core is text only)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.ops import glm5_next as ops_glm5_next  # noqa: F401 - registers the glm5_next ops
from helios.engine.kernels import glm5_next as kernels_glm5_next
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family_of_hf_config, glm5_next, glm_moe_dsa
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import CHAT, EIGHT_PLAIN_TEXTS, LONGER_TEXT, check_prefix_reuse, hf_logprobs

PAGE_TOKENS = 16


# ------------------------------------------------------------------------------------ ops


def _kda_inputs(total: int, heads: int = 3, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, heads, dim, generator=g) for _ in range(3))
    decay = -5 * torch.sigmoid(torch.randn(total, heads, dim, generator=g) - 2)
    beta = torch.sigmoid(torch.randn(total, heads, generator=g))
    return q, k, v, decay, beta


def test_kda_matches_transformers_and_is_chunk_independent() -> None:
    """flare::kda's reference and CPU kernel against transformers' chunked and recurrent KDA, with
    the sequence fed whole, in chunks of 16 and 5, and token by token (the state in a slot)."""
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

    total, dim = 37, 8
    q, k, v, g, beta = _kda_inputs(total, dim=dim)
    expected, final = chunk_kimi_delta_attention(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    positions = torch.arange(total)
    for op in (torch.ops.flare.kda, kernels_glm5_next.kda_cpu):
        for chunk in (total, 16, 5, 1):
            state = torch.full((3, 3, dim, dim), float("nan"))  # a fresh sequence never reads its slot
            out = []
            for start in range(0, total, chunk):
                end = min(total, start + chunk)
                qsl = torch.tensor([0, end - start], dtype=torch.int32)
                out.append(
                    op(
                        q[start:end],
                        k[start:end],
                        v[start:end],
                        g[start:end],
                        beta[start:end],
                        state,
                        torch.tensor([1]),
                        qsl,
                        positions[start:end],
                        dim**-0.5,
                        True,
                    )
                )
            assert float((torch.cat(out) - expected[0]).abs().max()) < 1e-5, (op, chunk)
            assert float((state[1] - final[0]).abs().max()) < 1e-5, (op, chunk)


@pytest.mark.parametrize("in_place", [False, True])
def test_kda_kernel_mixed_batch(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step holding a fresh prefill, a continuing prefill and two decode rows (one fresh) equals
    the reference op on the same slots (decode states gathered, or updated in place as large ones are)."""
    monkeypatch.setattr(kernels_glm5_next, "_IN_PLACE_BYTES", 1 if in_place else 1 << 40)
    q, k, v, g, beta = _kda_inputs(12, seed=1)
    initial = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(2)) * 0.1
    qsl = torch.tensor([0, 5, 6, 11, 12], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 9, 10, 11, 12, 13, 0])
    slots = torch.tensor([4, 0, 2, 3])
    a, b = initial.clone(), initial.clone()
    want = torch.ops.flare.kda(q, k, v, g, beta, a, slots, qsl, positions, 8**-0.5, True)
    got = kernels_glm5_next.kda_cpu(q, k, v, g, beta, b, slots, qsl, positions, 8**-0.5, True)
    assert float((got - want).abs().max()) < 1e-5 and float((a - b).abs().max()) < 1e-5


def test_kpool_topk_selects_pools_and_tail() -> None:
    """flare::kpool_topk over a paged cache against a direct computation: pooled keys, the best
    complete visible pools, the query's own incomplete pool."""
    gen = torch.Generator().manual_seed(3)
    pool, dim, heads, total = 4, 8, 5, 23
    rows = torch.randn(total, 2 * dim, generator=gen)
    ape = torch.randn(pool, dim, generator=gen)
    q, w = torch.randn(total, heads, dim, generator=gen), torch.randn(total, heads, generator=gen)
    cache = torch.zeros(4, 8, 1, 2 * dim)
    table = torch.tensor([[2, 0, 3, 1]])
    for t in range(total):
        cache[table[0, t // 8], t % 8, 0] = rows[t]
    got = torch.ops.flare.kpool_topk(
        q,
        w,
        cache,
        ape,
        table,
        torch.tensor([total]),
        torch.tensor([0, total]),
        torch.arange(total),
        dim**-0.5,
        pool,
        2,
        True,
    )
    assert got.shape == (total, 2 * pool + pool - 1)
    for t in range(total):
        kept = set(got[t][got[t] >= 0].tolist())
        complete = (t + 1) // pool
        scores = []
        for j in range(complete):
            probs = (rows[j * pool : (j + 1) * pool, dim:] + ape).softmax(0)
            key = (probs * rows[j * pool : (j + 1) * pool, :dim]).sum(0)
            scores.append(float((w[t] * (q[t] @ key * dim**-0.5).relu()).sum()))
        best = sorted(range(complete), key=lambda j: -scores[j])[:2]
        want = {j * pool + o for j in best for o in range(pool)} | set(range(complete * pool, t + 1))
        assert kept == want, t


# ------------------------------------------------------------------------------ the tiny core


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """(tiny checkpoint, its core with prompt logprobs, transformers' model)."""
    checkpoint = write_testmodel("glm5_next", tmp_path_factory.mktemp("ckpt") / "tiny-glm5-next", seed=3)
    core = tmp_path_factory.mktemp("cores") / "tiny-glm5-next"
    result = export_core(
        open_source(str(checkpoint)),
        load_recipe("glm53"),
        ExportOptions(out=core, prompt_logprobs=True, page_tokens=PAGE_TOKENS),
    )
    assert result.max_abs_diff <= 1e-3  # the self-check against the float64 reference
    print(f"export self-check max |Δ logprob|: {result.max_abs_diff:.3g}")
    return checkpoint, core, family_checks.hf_model(checkpoint, "Glm5NextForConditionalGeneration", eager=False)


@pytest.fixture
def tie_watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Inside transformers' indexer, compares its pool top-k with the ops' rule (ties to the earlier
    pool) on transformers' own pool scores: counts rows that drop pools, rows with an exact tie at
    the k-th score, and rows whose kept pools differ."""
    from transformers.models.glm5_next import modeling_glm5_next as hf

    inside = [False]
    forward = hf.Glm5NextTextIndexer.forward

    def indexer(self, *args, **kwargs):
        inside[0] = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(hf.Glm5NextTextIndexer, "forward", indexer)
    return family_checks.watch_topk_ties(monkeypatch, lambda scores, k, dim: inside[0] and scores.dim() == 3)


def _prompts(core: Core) -> list[list[int]]:
    """A chat through the GLM-5.3-Flash template, a short text, and one spanning many pools and pages."""
    return family_checks.chat_prompts(core, {"eos_token": "<|endoftext|>"}, "Hi there", LONGER_TEXT, chat=CHAT)


def test_core_records_the_recipe_and_layout(exported) -> None:
    checkpoint, core_dir, _ = exported
    m = Core.open(core_dir).manifest
    config = glm5_next.FAMILY.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    assert (m.model.family, m.recipe.name) == ("glm5_next", "glm53")
    assert m.kv.shared_kv and m.kv.num_layers == 4 and (m.kv.num_kv_heads, m.kv.head_dim) == (1, 32)
    assert [(e.name, e.layers, e.num_heads, e.head_dim) for e in m.kv.extra] == [("indexer_kg", (1,), 1, 32)]
    conv, recurrent = m.kv.state
    assert (conv.name, conv.layers, conv.shape) == ("conv", (0, 3), (192, 3))
    assert (recurrent.name, recurrent.layers, recurrent.shape) == ("recurrent", (0, 3), (4, 16, 16))
    assert {"causal_conv1d", "kda", "kpool_topk", "sparse_paged_attention"} <= set(m.ops.ops)
    assert config.indexer_layers == (1,) and config.indexer_types[2] == "shared"


def test_logprobs_match_transformers(exported, tie_watch: dict[str, int]) -> None:
    """Three prompts, prefilled whole and in chunks of 16 and 5 and (their first 20 tokens) one token
    at a time, every chunk after the first starting from the state slots; and the scored prefill's
    prompt logprobs; against transformers' full forward."""
    _, core_dir, model = exported
    prompts = _prompts(Core.open(core_dir))
    assert len(prompts[2]) > 4 * PAGE_TOKENS and len(prompts[0]) > PAGE_TOKENS + 4 > 8 + 3  # drops positions
    worst = family_checks.step_logprob_error(core_dir, model, prompts, decoded=PAGE_TOKENS + 4)  # past the first page
    worst = max(worst, family_checks.prompt_logprob_error(core_dir, model, prompts, chunk=16))
    print(f"max |Δ logprob| vs transformers (programs): {worst:.3g}; transformers' indexer rows: {tie_watch}")
    assert worst <= 1e-3
    assert tie_watch["dropping"] > 0 and tie_watch["differ"] == 0, tie_watch


def test_selection_matters(exported) -> None:
    """With every position kept (a large index_topk), transformers' own model answers differently."""
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    checkpoint, core_dir, model = exported
    ids = _prompts(Core.open(core_dir))[2]
    config = AutoConfig.from_pretrained(str(checkpoint))
    config.text_config.index_topk = 4096
    dense = Glm5NextForConditionalGeneration.from_pretrained(str(checkpoint), config=config, dtype=torch.float32).eval()
    assert float((hf_logprobs(dense, ids) - hf_logprobs(model, ids)).abs().max()) > 1e-2


def test_engine_generation_matches_transformers(exported) -> None:
    """Greedy generation through the engine (16-token prefill chunks, then decode rows through the
    state slots and the selected latent rows): each token's logprob and top alternatives equal
    transformers' on the whole sequence, for the three prompts."""
    _, core_dir, model = exported
    worst = family_checks.engine_logprob_error(core_dir, model, _prompts(Core.open(core_dir)))
    print(f"max |Δ logprob| vs transformers (engine): {worst:.3g}")
    assert worst <= 1e-3


def test_batching_invariance(exported) -> None:
    """8 prompts together (mixed prefill chunks and decode rows over the state slots) == each alone,
    with the prefix cache on and off and 16-token prefill chunks, and again from cached prefixes."""
    settings = ({}, {"enable_prefix_cache": False}, {"prefill_chunk_size": 16})
    family_checks.check_eight_prompts_batching(exported[1], "", tuple(EIGHT_PLAIN_TEXTS), settings)


def test_prefix_reuse(exported) -> None:
    check_prefix_reuse(exported[1], LONGER_TEXT, 8)


# ------------------------------------------------------------------------- config and layout

BASE = glm5_next.testmodel_config(300)


def _variant(out: Path, changes: dict, seed: int = 4) -> Path:
    """A tiny checkpoint with `changes` applied to its config (tensors regenerated to fit); a None
    linear_lower_bound is written as null (the softplus forget gate), other None fields left out."""
    dropped = [k for k, v in changes.items() if v is None and k != "linear_lower_bound"]
    return family_checks.write_variant("glm5_next", out, changes, seed, dropped)


@pytest.mark.parametrize(
    "changes",
    [
        {"linear_lower_bound": None},  # the softplus forget gate
        {"n_group": 2, "topk_group": 1, "tie_word_embeddings": True},
        {
            "layer_types": None,
            "indexer_types": None,
            "mlp_layer_types": None,
            "index_topk_freq": 2,
        },  # derived schedules
    ],
)
def test_reference_matches_transformers_on_variants(tmp_path: Path, changes: dict) -> None:
    """The export self-check's reference (float64) against transformers on config variants."""
    from transformers import Glm5NextForConditionalGeneration

    checkpoint = _variant(tmp_path / "ckpt", changes)
    source = open_source(str(checkpoint))
    config = glm5_next.FAMILY.config_from_hf(source.hf_config)
    model = Glm5NextForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    hf_config = model.config.text_config
    assert (list(config.layer_types), list(config.indexer_types), list(config.mlp_layer_types)) == (
        hf_config.layer_types,
        hf_config.indexer_types,
        hf_config.mlp_layer_types,
    )
    ids = list(range(5, 45))
    ours = torch.log_softmax(glm5_next.reference_logits(config, source.tensors, ids), dim=-1)
    assert float((ours - hf_logprobs(model, ids)).abs().max()) <= 1e-4


def test_glm_names_and_nested_config_read_the_same_model(tmp_path: Path) -> None:
    """GLM's own tensor names (per-expert experts, q/k/v convs, forget-gate and hc names under
    self_attn / the layer) and a nested text_config give the same weights; the vision tower and an
    MTP layer are left out."""
    checkpoint = open_source(str(write_testmodel("glm5_next", tmp_path / "ckpt", seed=2)))
    config = glm5_next.FAMILY.config_from_hf(checkpoint.hf_config)
    nested = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": {**checkpoint.hf_config, "model_type": "glm5_next_text"},
        "vision_config": {"depth": 1},
    }
    assert family_of_hf_config(nested) == "glm5_next" and glm5_next.FAMILY.config_from_hf(nested) == config
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.tensors.items():
        name = name.replace("self_attn.forget_gate.", "self_attn.")
        for block in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                name = name.replace(f"{block}_hc.{part}", f"hc_{block}_{part}")
        if name.endswith("conv1d.weight"):
            for part, piece in zip("qkv", tensor.chunk(3)):
                renamed[name.replace("conv1d", f"{part}_conv1d")] = piece
        elif name.endswith("experts.gate_up_proj"):
            for e, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                renamed[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                renamed[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e, stacked in enumerate(tensor):
                renamed[name.replace("down_proj", f"{e}.down_proj.weight")] = stacked
        else:
            renamed[name] = tensor
    renamed["model.language_model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer
    renamed["model.language_model.layers.3.shared_head.norm.weight"] = torch.zeros(4)
    ours = internal_weights(glm5_next.FAMILY, replace(checkpoint, tensors=renamed), config, torch.float32)
    plain = internal_weights(glm5_next.FAMILY, checkpoint, config, torch.float32)
    assert ours.keys() == plain.keys() and all(torch.equal(ours[n], plain[n]) for n in plain)
    assert not any("visual" in n for n in plain) and plain["layers.0.conv"].shape == (192, 1, 4)
    ids = list(range(3, 30))
    assert torch.equal(
        glm5_next.reference_logits(config, renamed, ids), glm5_next.reference_logits(config, checkpoint.tensors, ids)
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"qk_rope_head_dim": 8}, "qk_rope_head_dim"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "indexed_attention", "linear_attention"]},
            "layer_types",
        ),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        ({"indexer_types": ["full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full", "shared", "full", "full"]}, "indexer_types"),  # a shared layer after a KDA layer
        ({"index_topk": 6}, "index_topk"),
        ({"index_kpool": 0}, "index_kpool"),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ],
)
def test_unsupported_variants_are_refused(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        glm5_next.FAMILY.config_from_hf(BASE | change)


def test_glm_moe_dsa_points_glm5_next_configs_here() -> None:
    with pytest.raises(ValueError, match="glm5_next family"):
        glm_moe_dsa.config_from_hf(glm_moe_dsa.testmodel_config(300) | {"model_type": "glm5_next"})
    assert family_of_hf_config(BASE) == "glm5_next"


def test_schedules_follow_transformers() -> None:
    """layer_types / mlp_layer_types / indexer_types defaults and linear_attn_config, as
    Glm5NextTextConfig.__post_init__ derives them."""
    from transformers import Glm5NextTextConfig

    base = {
        k: v
        for k, v in BASE.items()
        if k not in ("layer_types", "indexer_types", "mlp_layer_types", "architectures", "vision_config", "model_type")
    }
    for extra in (
        {"num_hidden_layers": 8},
        {"num_hidden_layers": 8, "index_topk_pattern": "FFFFFFFF"},
        {
            "linear_attn_config": {
                "head_dim": 8,
                "num_heads": 2,
                "short_conv_kernel_size": 3,
                "gate_lower_bound": None,
                "safe_gate": False,
            }
        },
    ):
        hf = Glm5NextTextConfig(**(base | extra))
        ours = glm5_next.FAMILY.config_from_hf(base | extra)
        assert (list(ours.layer_types), list(ours.mlp_layer_types), list(ours.indexer_types)) == (
            hf.layer_types,
            hf.mlp_layer_types,
            hf.indexer_types,
        ), extra
        assert (ours.linear_head_dim, ours.linear_num_heads, ours.conv_kernel_size, ours.linear_lower_bound) == (
            hf.linear_head_dim,
            hf.linear_num_heads,
            hf.linear_conv_kernel_dim,
            hf.linear_lower_bound,
        ), extra


# ---------------------------------------------------------------------------- chat round trips

# The glm53 recipe's template, reasoning and tool syntax are the ones the glm_moe_dsa family's tests
# drive (tests/data/tiny_glm5.toml copies them): the same round trips run here on this family's core.
from tests.ignition.test_glm_moe_dsa import (  # noqa: E402
    test_chat_completion_with_reasoning_and_tool_call,  # noqa: F401
    test_messages_with_reasoning_and_tool_call,  # noqa: F401
    test_responses_with_reasoning_and_tool_call,  # noqa: F401
)

app = family_checks.served("exported")


def test_images_are_refused(app) -> None:
    """Text only: the vision tower is not compiled, so image parts are a client error."""
    family_checks.check_images_refused(app)
