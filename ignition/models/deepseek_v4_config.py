"""The DeepSeek-V4 family's checkpoint side: weight-name maps (transformers' and DeepSeek's original
layout), the frozen config read from config.json, and the cache layout it implies (one shared key=value
row per token, compressed-attention and indexer caches).

The step program and test checkpoints are in ignition.models.deepseek_v4; the reference forward in
ignition.models.deepseek_v4_reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ignition.models import moe
from ignition.models.common import HEAD_WEIGHT_MAP, PRE_NORM_WEIGHT_MAP, hyper_weight_map
from ignition.models.deepseek_v3_config import RopeSpec, yarn_rope
from ignition.models.hf_config import Fields
from ignition.models.naming import rename

NAME = "deepseek_v4"
HF_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
HF_MODEL_TYPES = ("deepseek_v4",)

# The raw rows are one tensor per layer, read as keys and values (KvLayout.shared_kv).
SHARED_KV = True

# Exports default to float32: a bfloat16 tiny core fails the self-check (1.46 > 1.0 in logprob,
# 1.18 with a float32 cache), so the 16-bit program is not yet accurate.
ACCURATE_16BIT = False

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
_LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # configs' per-layer `compress_ratios`
SCORINGS = ("sqrtsoftplus", "sigmoid")  # transformers' ACT2FN has no "softmax" router for this model

_L = "model.layers.{}."
_A = _L + "self_attn."
_C = _A + "compressor."
_I = _C + "indexer."
_HF_WEIGHT_MAP = {
    **HEAD_WEIGHT_MAP,
    "model.hc_head.hc_fn": "hc_head.fn",
    "model.hc_head.hc_base": "hc_head.base",
    "model.hc_head.hc_scale": "hc_head.scale",
    **PRE_NORM_WEIGHT_MAP,
    **hyper_weight_map(_L + "{block}_hc.{part}"),
    _A + "sinks": "layers.{}.sinks",
    _A + "q_a_proj.weight": "layers.{}.wq_a",
    _A + "q_a_norm.weight": "layers.{}.q_a_norm",
    _A + "q_b_proj.weight": "layers.{}.wq_b",
    _A + "kv_proj.weight": "layers.{}.wkv",
    _A + "kv_norm.weight": "layers.{}.kv_norm",
    _A + "o_a_proj.weight": "layers.{}.wo_a",
    _A + "o_b_proj.weight": "layers.{}.wo_b",
    _C + "position_bias": "layers.{}.comp.bias",
    _C + "kv_proj.weight": "layers.{}.comp.wkv",
    _C + "gate_proj.weight": "layers.{}.comp.wgate",
    _C + "kv_norm.weight": "layers.{}.comp.norm",
    _I + "position_bias": "layers.{}.index.bias",
    _I + "kv_proj.weight": "layers.{}.index.wkv",
    _I + "gate_proj.weight": "layers.{}.index.wgate",
    _I + "kv_norm.weight": "layers.{}.index.norm",
    _I + "q_b_proj.weight": "layers.{}.index.wq_b",
    _I + "scorer.weights_proj.weight": "layers.{}.index.w_heads",
    _L + "mlp.gate.tid2eid": "layers.{}.tid2eid",
    **moe.expert_weight_map(),
    **moe.shared_expert_weight_map(),
}
# DeepSeek's own names (the released checkpoints; transformers renames them at load, conversion_mapping
# "deepseek_v4"): the same tensors, experts one per tensor (w1 gate, w3 up, w2 down).
_O = "layers.{}."
ORIGINAL_WEIGHT_MAP = {
    "embed.weight": "embed",
    "head.weight": "lm_head",
    "norm.weight": "norm",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
    _O + "attn_norm.weight": "layers.{}.attn_norm",
    _O + "ffn_norm.weight": "layers.{}.mlp_norm",
    **hyper_weight_map(_O + "hc_{block}_{part}"),
    _O + "attn.attn_sink": "layers.{}.sinks",
    _O + "attn.wq_a.weight": "layers.{}.wq_a",
    _O + "attn.q_norm.weight": "layers.{}.q_a_norm",
    _O + "attn.wq_b.weight": "layers.{}.wq_b",
    _O + "attn.wkv.weight": "layers.{}.wkv",
    _O + "attn.kv_norm.weight": "layers.{}.kv_norm",
    _O + "attn.wo_a.weight": "layers.{}.wo_a",
    _O + "attn.wo_b.weight": "layers.{}.wo_b",
    **{
        f"{_O}attn.{where}.{name}": f"layers.{{}}.{part}.{target}"
        for where, part in (("compressor", "comp"), ("indexer.compressor", "index"))
        for name, target in (("ape", "bias"), ("wkv.weight", "wkv"), ("wgate.weight", "wgate"), ("norm.weight", "norm"))
    },
    _O + "attn.indexer.wq_b.weight": "layers.{}.index.wq_b",
    _O + "attn.indexer.weights_proj.weight": "layers.{}.index.w_heads",
    _O + "ffn.gate.weight": "layers.{}.w_router",
    _O + "ffn.gate.bias": "layers.{}.router_bias",
    _O + "ffn.gate.tid2eid": "layers.{}.tid2eid",
    _O + "ffn.experts.{}.w1.weight": "layers.{}.experts.{}.w_gate",
    _O + "ffn.experts.{}.w3.weight": "layers.{}.experts.{}.w_up",
    _O + "ffn.experts.{}.w2.weight": "layers.{}.experts.{}.w_down",
    _O + "ffn.shared_experts.w1.weight": "layers.{}.shared.w_gate",
    _O + "ffn.shared_experts.w3.weight": "layers.{}.shared.w_up",
    _O + "ffn.shared_experts.w2.weight": "layers.{}.w_shared_down",
}
WEIGHT_MAP = {**_HF_WEIGHT_MAP, **ORIGINAL_WEIGHT_MAP}
_HF_NAME_OF = {internal: name for name, internal in _HF_WEIGHT_MAP.items()}
_ORIGINAL_TO_HF = {name: _HF_NAME_OF[internal] for name, internal in ORIGINAL_WEIGHT_MAP.items()}


def canonical_name(name: str) -> str:
    """A tensor's DeepseekV4ForCausalLM name, whichever naming the checkpoint uses."""
    mapped = rename(name, _ORIGINAL_TO_HF)
    return name if mapped is None else mapped[0]


STACKED = moe.STACKED_EXPERTS
# Each compressor's kv and gate projections run as one matmul (sliding layers have neither).
FUSED = {
    "layers.{}.comp.w_kv_gate": ("layers.{}.comp.wkv", "layers.{}.comp.wgate"),
    "layers.{}.index.w_kv_gate": ("layers.{}.index.wkv", "layers.{}.index.wgate"),
    **moe.SHARED_EXPERT_FUSED,
}


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # of every query head and of the one shared key=value head
    q_lora_rank: int
    rms_norm_eps: float
    main_rope: RopeSpec  # sliding layers
    compress_rope: RopeSpec  # compressed layers: their rows, entries and indexer
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
    layer_rates: tuple[int, ...]  # per layer: tokens per compressed entry; 0 for sliding layers
    sliding_window: int  # every layer's raw rows: key j visible to a query at p iff p - window < j <= p
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by token id (tid2eid), not by score
    moe_intermediate_size: int  # each routed expert's and the shared expert's width
    activation: moe.ExpertActivation  # SwiGLU clamped at swiglu_limit (routed and shared experts)
    router: moe.RouterSpec  # top-k layers (scores + correction bias); hash layers weight by it too

    def is_compressed(self, layer: int) -> bool:
        return self.layer_rates[layer] > 0

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA

    def rope(self, layer: int) -> RopeSpec:
        return self.compress_rope if self.is_compressed(layer) else self.main_rope

    def state_dim(self, layer: int, indexer: bool = False) -> int:
        """One position's compressor state [kv | gate]: 2 x D (HCA) or 2 x 2D (CSA's two series)."""
        dim = self.index_head_dim if indexer else self.head_dim
        return 2 * dim * (2 if self.is_csa(layer) else 1)


def _rope_from(params: dict[str, Any], theta: float, head_dim: int, max_positions: int, label: str) -> RopeSpec:
    """One rotary (transformers' V4 rope_parameters[label]): plain or YaRN over the trailing dims."""
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or theta)
    prf = params.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * float(prf))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor {prf} gives a {dim}-dim rotary, which must be even and <= head_dim")
    if kind == "default":
        return RopeSpec(theta=theta, dim=dim, interleave=True)
    if kind != "yarn":
        raise ValueError(
            f"rope_parameters[{label!r}] rope_type {kind!r} is not supported by the {NAME} family "
            "(supported: default, yarn)"
        )
    return yarn_rope(params, theta, dim, True, max_positions)


def _ropes(hf: dict[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress) as DeepseekV4Config.__post_init__ builds them: nested `main`/`compress`
    parameters, or flat ones (YaRN keys) applying to the compressed layers only."""
    prf = hf.get("partial_rotary_factor")
    if prf is None:
        legacy = hf.get("qk_rope_head_dim")
        prf = legacy / head_dim if legacy is not None else 64 / 512
    max_positions = int(hf.get("max_position_embeddings", 1048576))
    params = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    theta, compress_theta = float(hf.get("rope_theta", 10000.0)), float(hf.get("compress_rope_theta", 160000.0))
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:  # flat parameters (YaRN's) apply to the compressed layers, whose cos/sin V4 does not rescale
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
        compress = flat | {"rope_theta": compress_theta, "partial_rotary_factor": prf}
        compress["rope_type"] = flat.get("rope_type") or flat.get("type") or "default"
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    return (
        _rope_from(main, theta, head_dim, max_positions, "main"),
        _rope_from(compress, compress_theta, head_dim, max_positions, "compress"),
    )


def _layer_types(hf: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    rates = dict(hf.get("compress_rates") or {CSA: 4, HCA: 128})
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if hf.get(legacy) is not None:
            rates[kind] = hf[legacy]
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        try:
            types = [_LEGACY_RATIO_TYPES[int(r)] for r in hf["compress_ratios"]]
        except KeyError as exc:
            raise ValueError(f"compress_ratios entry {exc} is not one of {sorted(_LEGACY_RATIO_TYPES)}") from None
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = tuple(types[:n])
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must name {n} layers from {LAYER_TYPES}, got {list(types)}")
    out = []
    for t in types:
        rate = 0 if t == SLIDING else rates.get(t)
        if t != SLIDING and (not isinstance(rate, int) or rate < 1):
            raise ValueError(f"compress_rates[{t!r}] must be a positive integer, got {rate!r}")
        out.append(int(rate or 0))
    return types, tuple(out)


def _hash_layers(hf: dict[str, Any], n: int) -> tuple[bool, ...]:
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        hashed = hf.get("num_hash_layers")
        hashed = 3 if hashed is None else int(hashed)
        kinds = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    kinds = list(kinds[:n])
    if len(kinds) != n or any(k not in (HASH_MOE, MOE) for k in kinds):
        raise ValueError(f"mlp_layer_types must name {n} layers from {(HASH_MOE, MOE)}, got {kinds}")
    return tuple(k == HASH_MOE for k in kinds)


def _check_supported(hf: dict[str, Any]) -> None:
    """Variants the transformers reference computes differently from what the field says, or not at all."""
    refusals = {
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "only silu experts are implemented"),
        "scoring_func": (hf.get("scoring_func", "sqrtsoftplus") not in SCORINGS, f"supported: {', '.join(SCORINGS)}"),
        "n_shared_experts": (
            int(hf.get("n_shared_experts", 1) or 0) != 1,
            "the reference builds exactly one shared expert",
        ),
        "norm_topk_prob": (not hf.get("norm_topk_prob", True), "the reference always renormalizes the top-k weights"),
        "num_key_value_heads": (int(hf.get("num_key_value_heads", 1) or 1) != 1, "V4 attention has one shared kv head"),
        "attention_bias": (bool(hf.get("attention_bias")), "the reference's projections have no bias"),
        "mlp_bias": (bool(hf.get("mlp_bias")), "biased shared experts are not implemented"),
        "swiglu_limit": (not float(hf.get("swiglu_limit", 10.0) or 0) > 0, "the SwiGLU clamp must be positive"),
        "sliding_window": (not int(hf.get("sliding_window", 128) or 0) > 0, "every V4 layer has a sliding window"),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"{name} = {hf.get(name)!r} is not supported by the {NAME} family ({why})")


# The fields read as they stand in config.json (with DeepseekV4Config's defaults).
_FIELDS = Fields(
    DeepseekV4Config,
    vocab_size=129280,
    hidden_size=4096,
    q_lora_rank=1024,
    rms_norm_eps=1e-6,
    max_position_embeddings=1048576,
    tie_word_embeddings=False,
    sliding_window=128,
    o_lora_rank=1024,
    index_n_heads=64,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    moe_intermediate_size=2048,
)


def config_from_hf(hf: dict[str, Any]) -> DeepseekV4Config:
    """Read a Hugging Face config.json dict, resolving V4's legacy keys as transformers does."""
    _check_supported(hf)
    n = int(hf.get("num_hidden_layers", 43))
    head_dim = int(hf.get("head_dim", 512))
    heads = int(hf.get("num_attention_heads", 64))
    main_rope, compress_rope = _ropes(hf, head_dim)
    layer_types, layer_rates = _layer_types(hf, n)
    o_groups, index_head_dim = int(hf.get("o_groups", 8)), int(hf.get("index_head_dim", 128))
    if (heads * head_dim) % o_groups:
        raise ValueError(f"o_groups {o_groups} must divide num_attention_heads * head_dim = {heads * head_dim}")
    if CSA in layer_types and compress_rope.dim > index_head_dim:
        raise ValueError(f"index_head_dim {index_head_dim} is smaller than the {compress_rope.dim}-dim rotary")
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 256)
    router = moe.RouterSpec(
        num_experts=experts,
        top_k=int(hf.get("num_experts_per_tok", 6)),
        scoring=str(hf.get("scoring_func", "sqrtsoftplus")),
        norm_topk_prob=True,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        has_correction_bias=True,
        norm_eps=1e-20,
    )
    return DeepseekV4Config(
        **_FIELDS.read(hf),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        main_rope=main_rope,
        compress_rope=compress_rope,
        layer_types=layer_types,
        layer_rates=layer_rates,
        o_groups=o_groups,
        index_head_dim=index_head_dim,
        hash_layers=_hash_layers(hf, n),
        activation=moe.ExpertActivation("silu", limit=float(hf.get("swiglu_limit", 10.0))),
        router=router,
    )


def kv_shape(config: DeepseekV4Config) -> tuple[int, int, int]:
    """(num_layers, 1, head_dim): one shared key=value row per token and layer (SHARED_KV)."""
    return config.num_layers, 1, config.head_dim


def extra_caches(config: DeepseekV4Config) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """The per-position caches after the raw rows, in the program's order (KvLayout.extra: one
    (name, (layer,), rows, dim) entry per tensor)."""
    out: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(config.num_layers):
        if not config.is_compressed(i):
            continue
        out += [
            (f"layers.{i}.compressor_state", (i,), 1, config.state_dim(i)),
            (f"layers.{i}.compressed_kv", (i,), 1, config.head_dim),
        ]
        if config.is_csa(i):
            out += [
                (f"layers.{i}.indexer_state", (i,), 1, config.state_dim(i, indexer=True)),
                (f"layers.{i}.indexer_keys", (i,), 1, config.index_head_dim),
            ]
    return tuple(out)


def decode_weight_bytes(config: DeepseekV4Config, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per layer (and one row
    of each hash layer's token -> expert table)."""
    tables = sum(
        t.numel() * t.element_size() * (t.shape[0] - 1) // t.shape[0]
        for name, t in weights.items()
        if name.endswith(".tid2eid")
    )
    return moe.decode_weight_bytes(config, weights, config.router.top_k) - tables
