"""Routed MoE (ignition.models.moe, flare::routed_experts): routing against transformers'
routers, the op against transformers' expert modules and a per-token loop, helios' kernel
against the reference, batching invariance, expert stacking, and a core exported from a
checkpoint that stores its experts already stacked (transformers 5's layout)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helios.core import Core
from helios.core.ops.moe import expert_forward, reference_routed_experts
from helios.core.program import run_prompt
from helios.engine import graph
from helios.engine.kernels.moe import routed_experts_cpu
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core
from ignition.models import moe, qwen3_moe
from ignition.models.naming import rename
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

HIDDEN = 32


def _config(**fields: object) -> SimpleNamespace:
    """The attributes transformers' router and expert modules read from their config."""
    base = {"hidden_size": HIDDEN, "hidden_act": "silu", "_experts_implementation": "eager"}
    return SimpleNamespace(**(base | fields))


def _qwen3(e: int, k: int, norm: bool):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    spec = moe.RouterSpec(e, k, "softmax", norm)
    return Qwen3MoeTopKRouter(_config(num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm)), spec


def _grouped_sigmoid(router: type, e: int, k: int, norm: bool, groups: tuple[int, int], scaling: float):
    """A DeepSeek-V3-style router (sigmoid scores, a selection bias, `groups` = (n_group, topk_group),
    `scaling` the routed_scaling_factor) and its spec."""
    n_group, topk_group = groups
    fields = {"n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": scaling}
    config = _config(num_local_experts=e, num_experts_per_tok=k, norm_topk_prob=norm, **fields)
    spec = moe.RouterSpec(e, k, "sigmoid", norm, has_correction_bias=True, norm_eps=1e-20, **fields)
    return router(config), spec


def _deepseek_v3(e: int, k: int, norm: bool):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return _grouped_sigmoid(DeepseekV3TopkRouter, e, k, norm, (4, 2), 2.5)


def _glm_moe_dsa(e: int, k: int, norm: bool):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    return _grouped_sigmoid(GlmMoeDsaTopkRouter, e, k, norm, (8, 3), 1.8)


def _minimax_m3(e: int, k: int, norm: bool):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLTopKRouter

    # Always renormalized; its routed_scaling_factor multiplies the experts' sum in the block.
    spec = moe.RouterSpec(e, k, "sigmoid", True, has_correction_bias=True)
    return MiniMaxM3VLTopKRouter(_config(num_local_experts=e, num_experts_per_tok=k)), spec


def _step3p7(e: int, k: int, norm: bool):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TopKRouter

    spec = moe.RouterSpec(e, k, "sigmoid", True, has_correction_bias=True)
    return Step3p7TopKRouter(_config(num_local_experts=e, num_experts_per_tok=k)), spec


def _muse_spark(e: int, k: int, norm: bool):
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTopkRouter

    config = _config(num_local_experts=e, num_experts_per_tok=k, output_multiplier=0.177, routed_scaling_factor=1.5)
    spec = moe.RouterSpec(
        e, k, "sigmoid", True, routed_scaling_factor=1.5, has_correction_bias=True, norm_eps=1e-15, logit_scale=0.177
    )
    return MuseSparkTopkRouter(config), spec


def _deepseek_v4(e: int, k: int, norm: bool):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    config = _config(num_local_experts=e, num_experts_per_tok=k, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    spec = moe.RouterSpec(
        e, k, "sqrtsoftplus", True, routed_scaling_factor=1.5, has_correction_bias=True, norm_eps=1e-20
    )
    return DeepseekV4TopKRouter(config), spec


ROUTERS = {
    "qwen3_moe": _qwen3,
    "deepseek_v3": _deepseek_v3,
    "glm_moe_dsa": _glm_moe_dsa,
    "minimax_m3": _minimax_m3,
    "step3p7": _step3p7,
    "muse_spark": _muse_spark,
    "deepseek_v4": _deepseek_v4,
}


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors reordered by expert id per token (routers may return top-k unsorted)."""
    order = ids.argsort(dim=-1)
    return weights.float().gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_route_matches_transformers_router(name: str, norm: bool) -> None:
    gen = torch.Generator().manual_seed(len(name) + norm)
    router, spec = ROUTERS[name](32, 6, norm)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if spec.has_correction_bias:  # large enough to change which experts win
            router.e_score_correction_bias.copy_(torch.randn(32, generator=gen) * 0.3)
        h = torch.randn(40, HIDDEN, generator=gen)
        _, hf_weights, hf_ids = router(h)
        logits = F.linear(h, router.weight)
        bias = router.e_score_correction_bias if spec.has_correction_bias else None
        got = _by_id(*moe.route(spec, logits, bias))
    expected = _by_id(hf_weights, hf_ids)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    # The self-check's reference routes independently (sorting, not topk) to the same choice.
    ref_ids = moe._reference_choice(spec, moe._reference_scores(spec, logits) + (bias if bias is not None else 0.0))
    assert torch.equal(ref_ids.sort(-1).values, expected[1])


def test_fixed_ids_are_weighted_like_deepseek_v4_hash_routing() -> None:
    """Hash layers pick experts by token id; weights_at still weights them by the learned scores."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    config = _config(
        num_local_experts=16,
        num_experts_per_tok=3,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        vocab_size=50,
    )
    router = DeepseekV4HashRouter(config)
    gen = torch.Generator().manual_seed(20)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, HIDDEN, generator=gen))
        router.tid2eid.copy_(torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(50)]))
        h, token_ids = torch.randn(9, HIDDEN, generator=gen), torch.randint(0, 50, (9,), generator=gen)
        _, expected, hf_ids = router(h, token_ids)
    spec = moe.RouterSpec(16, 3, "sqrtsoftplus", True, routed_scaling_factor=1.5, norm_eps=1e-20)
    ids = router.tid2eid[token_ids]
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(moe.weights_at(spec, moe.scores(spec, F.linear(h, router.weight)), ids), expected)


def test_group_limited_routing_only_picks_from_the_best_groups() -> None:
    """Group scores are the sum of each group's two best (biased) scores, not its best one."""
    spec = moe.RouterSpec(8, 2, "sigmoid", True, n_group=4, topk_group=1, has_correction_bias=True)
    bias = torch.zeros(8)
    logits = torch.tensor([[4.0, -9.0, 2.0, 2.0, -9.0, -9.0, -9.0, -9.0]])  # group 0: 0.98 + ~0; group 1: 0.88 + 0.88
    _, ids = moe.route(spec, logits, bias)
    assert sorted(ids[0].tolist()) == [2, 3]


# ------------------------------------------------------------------------------ the op


def _experts(seed: int, e: int, f: int, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(e, 2 * f, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(e, hidden, f, generator=gen) / f**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _routing(seed: int, tokens: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, e, generator=gen).softmax(-1).topk(k, dim=-1)


def _per_token(h, weights, ids, w_gate_up, w_down, **act) -> torch.Tensor:
    """The op's meaning, spelled out one token and one chosen expert at a time."""
    out = torch.zeros(h.shape[0], h.shape[1])
    for t in range(h.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += weights[t, k] * expert_forward(h[t : t + 1], w_gate_up[e], w_down[e], **act)[0]
    return out


ACTS = {
    "silu": {},
    "silu_clamp": {"activation": "silu", "limit": 0.5},
    "silu_clamp_after": {"activation": "silu_clamp_after", "limit": 0.3},
    "clamped_glu": {"activation": "clamped_glu", "limit": 0.5, "alpha": 1.702},
    "post_norm": {"post_norm_scale": torch.linspace(0.5, 1.5, HIDDEN), "post_norm_eps": 1e-6},
}


@pytest.mark.parametrize("act", sorted(ACTS))
def test_reference_kernel_matches_a_per_token_loop(act: str) -> None:
    w_gate_up, w_down = _experts(1, 8, 16)
    weights, ids = _routing(2, 13, 8, 3)
    h = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3))
    got = torch.ops.flare.routed_experts(h, weights, ids, w_gate_up, w_down, **ACTS[act])
    torch.testing.assert_close(reference_routed_experts(h, weights, ids, w_gate_up, w_down, **ACTS[act]), got)
    torch.testing.assert_close(got, _per_token(h, weights, ids, w_gate_up, w_down, **ACTS[act]), rtol=1e-5, atol=1e-6)


def _hf_experts(name: str, w_gate_up: torch.Tensor, w_down: torch.Tensor):
    """transformers' expert module of a family with our stacked weights, and its op arguments."""
    e, f = w_gate_up.shape[0], w_down.shape[2]
    config = _config(
        num_local_experts=e,
        num_experts=e,
        intermediate_size=f,
        moe_intermediate_size=f,
        swiglu_limit=0.5,
        swiglu_alpha=1.702,
        moe_hidden_size=HIDDEN,
        post_norm_eps=1e-6,
    )
    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        module, act = cls(config), {}
    elif name == "deepseek_v4":
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts as cls

        module, act = cls(config), {"activation": "silu", "limit": 0.5}
    elif name == "step3p7":
        from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts as cls

        module, act = cls(config, swiglu_limit=0.3), {"activation": "silu_clamp_after", "limit": 0.3}
    elif name == "minimax_m3":
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts as cls

        module, act = cls(config), {"activation": "clamped_glu", "limit": 0.5, "alpha": 1.702}
    else:
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts as cls

        module = cls(config)
        module.post_expert_norm.weight.data = torch.linspace(-0.5, 0.5, HIDDEN)
        act = {"post_norm_scale": 1.0 + module.post_expert_norm.weight.detach()}
    module.gate_up_proj.data, module.down_proj.data = w_gate_up.clone(), w_down.clone()
    return module, act


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v4", "step3p7", "minimax_m3", "muse_spark"])
def test_op_matches_transformers_experts(name: str) -> None:
    w_gate_up, w_down = _experts(4, 8, 16)
    weights, ids = _routing(5, 11, 8, 2)
    h = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(6)) * 3  # large enough to hit the clamps
    module, act = _hf_experts(name, w_gate_up, w_down)
    with torch.no_grad():
        expected = module(h, ids, weights)
    got = moe.routed_mlp(
        h,
        weights,
        ids,
        w_gate_up,
        w_down,
        moe.ExpertActivation(act.get("activation", "silu"), act.get("limit", 0.0), act.get("alpha", 1.0)),
        act.get("post_norm_scale"),
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_the_chosen_experts_run() -> None:
    """Experts no token chose hold NaN: a dense computation would spread them into every row."""
    w_gate_up, w_down = _experts(7, 16, 8)
    weights, ids = _routing(8, 5, 16, 2)
    unused = sorted(set(range(16)) - set(ids.flatten().tolist()))
    assert unused
    w_gate_up[unused], w_down[unused] = float("nan"), float("nan")
    h = torch.randn(5, HIDDEN)
    for kernel in (reference_routed_experts, routed_experts_cpu):
        assert torch.isfinite(kernel(h, weights, ids, w_gate_up, w_down)).all()


CASES = {  # tokens, experts, top_k, F, dtype: the unsorted decode path, grouped matmuls, the loop fallback
    "decode": (1, 16, 4, 8, torch.float32),
    "small batch": (2, 16, 2, 8, torch.float32),
    "batch": (24, 16, 4, 8, torch.float32),
    "all experts": (9, 8, 8, 8, torch.float32),
    "unaligned": (24, 16, 4, 6, torch.float32),  # 6 fp32 rows are 24 bytes: not a grouped-matmul stride
    "bf16 decode": (1, 16, 4, 8, torch.bfloat16),
    "bf16 batch": (24, 16, 4, 8, torch.bfloat16),
}


@pytest.mark.parametrize("act", ["silu", "clamped_glu", "post_norm"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_helios_kernel_matches_the_reference(case: str, act: str) -> None:
    tokens, e, k, f, dtype = CASES[case]
    w_gate_up, w_down = _experts(9, e, f, dtype=dtype)
    weights, ids = _routing(10, tokens, e, k)
    h = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(11)).to(dtype)
    expected = reference_routed_experts(h, weights, ids, w_gate_up, w_down, **ACTS[act])
    got = routed_experts_cpu(h, weights, ids, w_gate_up, w_down, **ACTS[act])
    assert got.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", [reference_routed_experts, routed_experts_cpu], ids=["reference", "helios"])
def test_rows_together_equal_each_row_alone(kernel) -> None:
    w_gate_up, w_down = _experts(12, 16, 8)
    weights, ids = _routing(13, 20, 16, 4)
    h = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(14))
    together = kernel(h, weights, ids, w_gate_up, w_down)
    alone = torch.cat([kernel(h[t : t + 1], weights[t : t + 1], ids[t : t + 1], w_gate_up, w_down) for t in range(20)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_routed_mlp_exports_with_a_dynamic_token_count() -> None:
    spec = moe.RouterSpec(16, 4, "sigmoid", True, n_group=4, topk_group=2, has_correction_bias=True)
    w_gate_up, w_down = _experts(15, 16, 8)
    router, bias = torch.randn(16, HIDDEN), torch.randn(16) * 0.1

    class Layer(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            weights, ids = moe.route(spec, h @ router.T, bias)
            return moe.routed_mlp(h, weights, ids, w_gate_up, w_down)

    h = torch.randn(5, HIDDEN)
    exported = torch.export.export(Layer(), (h,), dynamic_shapes=({0: torch.export.Dim("T", min=1)},))
    assert any(n.target is torch.ops.flare.routed_experts.default for n in exported.graph.nodes)
    h2 = torch.randn(7, HIDDEN)
    torch.testing.assert_close(exported.module()(h2), Layer()(h2))


# ---------------------------------------------------------------- weights and the reference


def _hf_moe(seed: int, e: int, f: int, shared: bool) -> dict[str, torch.Tensor]:
    """A DeepSeek-style MoE block's weights under transformers' per-expert names."""
    gen = torch.Generator().manual_seed(seed)
    w = {
        "gate.weight": torch.randn(e, HIDDEN, generator=gen),
        "gate.e_score_correction_bias": torch.rand(e, generator=gen),
    }
    for i in range(e):
        for name, shape in (("gate_proj", (f, HIDDEN)), ("up_proj", (f, HIDDEN)), ("down_proj", (HIDDEN, f))):
            w[f"experts.{i}.{name}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    if shared:
        for name, shape in (
            ("gate_proj", (2 * f, HIDDEN)),
            ("up_proj", (2 * f, HIDDEN)),
            ("down_proj", (HIDDEN, 2 * f)),
        ):
            w[f"shared_experts.{name}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    return w


def _internal(hf: dict[str, torch.Tensor], layer: int = 0) -> dict[str, torch.Tensor]:
    """hf (names under one layer's mlp.) mapped and stacked as export does, fused shared expert included."""
    table = moe.expert_weight_map() | moe.shared_expert_weight_map()
    named = {rename(f"model.layers.{layer}.mlp.{n}", table)[0]: t for n, t in hf.items()}
    moe.stack_experts(moe.STACKED_EXPERTS, named, "test")
    for fused, parts in moe.SHARED_EXPERT_FUSED.items():
        names = [p.format(layer) for p in parts]
        if names[0] in named:
            named[fused.format(layer)] = torch.cat([named.pop(n) for n in names])
    return named


def test_program_path_matches_transformers_deepseek_v3_moe_block() -> None:
    """sparse_moe over stacked internal weights and reference_moe over Hugging Face names,
    both against transformers' DeepseekV3MoE (group-limited sigmoid routing + a shared expert)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    e, f = 16, 8
    hf = _hf_moe(16, e, f, shared=True)
    config = _config(
        num_local_experts=e,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        moe_intermediate_size=f,
        n_shared_experts=2,
        intermediate_size=64,
    )
    block = DeepseekV3MoE(config)
    stacked = _internal(hf)
    block.load_state_dict(
        {k: v for k, v in hf.items() if not k.startswith("experts.")}
        | {
            "experts.gate_up_proj": stacked["layers.0.w_experts_gate_up"],
            "experts.down_proj": stacked["layers.0.w_experts_down"],
        }
    )
    spec = moe.RouterSpec(
        e,
        4,
        "sigmoid",
        True,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        has_correction_bias=True,
        norm_eps=1e-20,
    )
    h = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        expected = block(h[None])[0]
    with_shared = moe.MoeBlock(spec, shared=True)
    torch.testing.assert_close(moe.sparse_moe(with_shared, stacked, 0, h), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.reference_moe(with_shared, hf, "", h), expected, rtol=1e-5, atol=1e-5)


def test_stacking_reads_every_expert_layout() -> None:
    """Per-expert tensors, transformers 5's stacked tensors, and separately stacked gate/up
    (Step 3.7's checkpoints) all end as the same [E, 2F, H] / [E, H, F] stacks."""
    hf = _hf_moe(18, 4, 8, shared=False)
    per_expert = _internal(hf)
    gate_up = torch.stack(
        [torch.cat([hf[f"experts.{i}.gate_proj.weight"], hf[f"experts.{i}.up_proj.weight"]]) for i in range(4)]
    )
    down = torch.stack([hf[f"experts.{i}.down_proj.weight"] for i in range(4)])
    torch.testing.assert_close(per_expert["layers.0.w_experts_gate_up"], gate_up, rtol=0, atol=0)
    torch.testing.assert_close(per_expert["layers.0.w_experts_down"], down, rtol=0, atol=0)
    stacked_hf = {"gate.weight": hf["gate.weight"], "experts.gate_up_proj": gate_up, "experts.down_proj": down}
    assert _internal(stacked_hf).keys() == {
        "layers.0.w_router",
        "layers.0.w_experts_gate_up",
        "layers.0.w_experts_down",
    }
    split = {"layers.1.moe_gate": gate_up[:, :8], "layers.1.moe_up": gate_up[:, 8:]}
    moe.stack_experts({"layers.{}.w_experts_gate_up": ("layers.{}.moe_gate", "layers.{}.moe_up")}, split, "test")
    torch.testing.assert_close(split.pop("layers.1.w_experts_gate_up"), gate_up, rtol=0, atol=0)
    assert not split
    # The independent reference reads both layouts to the same result.
    block = moe.MoeBlock(moe.RouterSpec(4, 2, "softmax", True))
    h = torch.randn(6, HIDDEN)
    torch.testing.assert_close(moe.reference_moe(block, hf, "", h), moe.reference_moe(block, stacked_hf, "", h))


def test_stacking_refuses_missing_experts() -> None:
    named = _internal(_hf_moe(19, 4, 8, shared=False))  # stacked already: no parts left
    named |= {f"layers.1.experts.{i}.w_gate": torch.zeros(8, HIDDEN) for i in (0, 1, 3)}
    named |= {f"layers.1.experts.{i}.w_up": torch.zeros(8, HIDDEN) for i in (0, 1, 3)}
    with pytest.raises(SourceError, match=r"layer 1 lacks experts \[2\]"):
        moe.stack_experts(moe.STACKED_EXPERTS, named, "test")


def test_decode_weight_bytes_count_only_the_routed_experts() -> None:
    config = SimpleNamespace(tie_word_embeddings=True)
    weights = {
        "embed": torch.zeros(10, 4),
        "layers.0.w_experts_gate_up": torch.zeros(8, 6, 4),
        "layers.0.w_experts_down": torch.zeros(8, 4, 3),
    }
    assert moe.decode_weight_bytes(config, weights, 2) == 4 * (40 + 2 * 24 + 2 * 12)


# ---------------------------------------------------------------- a stacked-layout checkpoint


def test_core_from_a_stacked_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """transformers 5 checkpoints may store experts as `mlp.experts.gate_up_proj` [E, 2F, H]
    and `mlp.experts.down_proj` [E, H, F]; the core reads them and still matches transformers."""
    from transformers import AutoModelForCausalLM

    checkpoint = write_testmodel("qwen3_moe", tmp_path / "ckpt", seed=5)
    config = json.loads((checkpoint / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        count = config["num_experts"]
        gate_up = [
            torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
            for e in range(count)
        ]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(count)])
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})

    core_dir = tmp_path / "core"
    export_core(
        open_source(str(checkpoint)),
        load_recipe(str(Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3_moe.toml")),
        ExportOptions(out=core_dir),
    )
    core = Core.open(core_dir)
    weights, m = core.load_weights(), core.manifest
    e, f, h = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
    assert weights["layers.1.w_experts_gate_up"].shape == (e, 2 * f, h)
    assert weights["layers.1.w_experts_down"].shape == (e, h, f)
    assert not any(".experts." in name for name in weights)
    program = core.load_program()
    assert any(n.target is torch.ops.flare.routed_experts.default for n in program.module.graph.nodes)
    assert "routed_experts" in m.ops.ops
    assert m.decode_weight_bytes < sum(t.numel() * t.element_size() for t in weights.values())
    ids = list(range(3, 40))
    got = run_prompt(program, weights, m.kv, m.limits.page_tokens, ids, chunk=6).logprobs
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert float((got - expected).abs().max()) <= 1e-4
    graph.simplify(program)  # as helios serves it: the op calls helios' kernel directly
    served = run_prompt(program, weights, m.kv, m.limits.page_tokens, ids, chunk=6).logprobs
    assert float((served - expected).abs().max()) <= 1e-4
    reference = qwen3_moe.reference_logits(qwen3_moe.config_from_hf(config), open_source(str(checkpoint)).tensors, ids)
    assert float((torch.log_softmax(reference, -1) - expected).abs().max()) <= 1e-4
