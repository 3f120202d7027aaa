"""The MiMo-V2 family's checkpoint side: weight-name maps, the frozen config read from config.json,
and the cache layout it implies (packed key|value pages, sliding layers' pooled windows).

The step program, MTP drafter, reference forward and test checkpoints are in ignition.models.mimo_v2."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ignition.models import moe, mtp
from ignition.models.hf_config import Fields, grouped_sigmoid_router

NAME = "mimo_v2"
HF_ARCHITECTURES = ("MiMoV2FlashForCausalLM",)
HF_MODEL_TYPES = ("mimo_v2_flash",)

SHARED_KV = True  # one packed key|value tensor per layer (flare::sink_attention)

# Exports default to float32: on the tiny random checkpoint a bfloat16 core flips routing choices
# and fails the self-check (1.1 in logprob; an all-dense variant passes at 0.065), so 16-bit waits
# for a check on a real checkpoint (as step5's and deepseek_v4's).
ACCURATE_16BIT = False

SLIDING, FULL = "sliding_attention", "full_attention"

_L, _M = "model.layers.{}.", "model.mtp.layers.{}."
_ATTENTION = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.sinks": "sinks",  # transformers' name
    "self_attn.attention_sink_bias": "sinks",  # the hub checkpoints'
    "mlp.gate_proj.weight": "w_gate",  # dense layers
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_MTP = {
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "eh_proj.weight": "eh_proj",
    "final_layernorm.weight": "final_norm",
    "pre_mlp_layernorm.weight": "mlp_norm",
}

# Hugging Face checkpoint name -> internal name; MTP layer N's tensors become "mtp.N.*".
WEIGHT_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    **{_L + k: "layers.{}." + v for k, v in _ATTENTION.items()},
    **moe.expert_weight_map(),
    **{_M + k: "mtp.{}." + v for k, v in (_ATTENTION | _MTP).items()},
}
STACKED = moe.STACKED_EXPERTS
# The MTP layers (mtp.N.*) stay unfused (FUSED names layers.N.*); dense and MoE layers each lack the other's group.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}

_MTP_NAME = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Partial rotate-half rotary of one layer type, as transformers' default rope with a partial factor."""

    theta: float
    dim: int  # int(head_dim * partial_rotary_factor): the exponent's denominator

    @property
    def pairs(self) -> int:
        """Rotated pairs: len(range(0, dim, 2)); the first 2 * pairs dims of a head rotate."""
        return (self.dim + 1) // 2


@dataclass(frozen=True, slots=True)
class MiMoV2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' (and MTP layers') SwiGLU width
    num_layers: int
    num_heads: int
    num_kv_heads: int  # full-attention layers; sliding layers have twice as many
    head_dim: int  # queries and keys
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_windows: tuple[int, ...]  # sliding window in keys (query included), 0 = full attention
    layer_sparse: tuple[bool, ...]  # MoE (True) or dense MLP
    rope_full: RopeSpec
    rope_sliding: RopeSpec
    value_scale: float  # attention_value_scale: multiplies values before the cache
    moe_intermediate_size: int
    router: moe.RouterSpec
    num_mtp_layers: int  # num_nextn_predict_layers: MTP layers compiled as mtp_draft.N programs
    sliding_window: int  # the window of sliding (and MTP) layers

    def kv_heads(self, sliding: bool) -> int:
        return 2 * self.num_kv_heads if sliding else self.num_kv_heads

    @property
    def cache_heads(self) -> int:
        """kv heads of each cache tensor: the most any layer (MTP included) has."""
        return self.kv_heads(any(self.layer_windows) or self.num_mtp_layers > 0)

    @property
    def row_width(self) -> int:
        """One cache row per kv head: the key [head_dim] then the value [v_head_dim]."""
        return self.head_dim + self.v_head_dim


# Hub config fields transformers does not read: the value transformers' own computation implies.
_HUB_SAME_AS = {
    "swa_num_attention_heads": "num_attention_heads",
    "swa_head_dim": "head_dim",
    "swa_v_head_dim": "v_head_dim",
    "layernorm_epsilon": "rms_norm_eps",
}
_TRANSFORMERS_DEFAULTS = {
    "num_attention_heads": 64,
    "head_dim": 192,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-5,
    "num_key_value_heads": 4,
}
_ROPE_DEFAULTS = {
    FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{field} = {value!r} is not supported by the {NAME} family: {why}")


def _get(hf: dict[str, Any], name: str) -> Any:
    return hf.get(name, _TRANSFORMERS_DEFAULTS.get(name))


def _check_supported(hf: dict[str, Any]) -> None:
    for field, why in (
        ("quantization_config", "quantized checkpoints are dequantized by the source reader only"),
        ("attention_bias", "q/k/v biases are not implemented"),
        ("n_shared_experts", "transformers' MiMo-V2 has no shared experts"),
        ("add_full_attention_sink_bias", "transformers puts sinks on sliding layers only"),
    ):
        if hf.get(field):
            raise _refuse(field, hf[field], why)
    if hf.get("add_swa_attention_sink_bias") is False:
        raise _refuse("add_swa_attention_sink_bias", False, "transformers always gives sliding layers sinks")
    for field, expected in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(field, expected) != expected:
            raise _refuse(field, hf[field], f"only {expected!r} is implemented (as transformers computes it)")
    for field, same in _HUB_SAME_AS.items():
        if field in hf and hf[field] != _get(hf, same):
            raise _refuse(field, hf[field], f"transformers ignores it and uses {same} = {_get(hf, same)!r}")
    kv = int(_get(hf, "num_key_value_heads"))
    if "swa_num_key_value_heads" in hf and int(hf["swa_num_key_value_heads"]) != 2 * kv:
        raise _refuse(
            "swa_num_key_value_heads",
            hf["swa_num_key_value_heads"],
            f"transformers gives sliding layers twice num_key_value_heads ({2 * kv})",
        )


def _layer_types(hf: dict[str, Any], n: int) -> list[str]:
    types = hf.get("layer_types")
    if types is None:  # transformers' default: full attention at layer 0 and every 6th layer
        types = [FULL if i == 0 or not (i + 1) % 6 else SLIDING for i in range(n)]
    types = list(types)
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise _refuse("layer_types", types, f"it must name {n} layers as {FULL!r} or {SLIDING!r}")
    pattern = hf.get("hybrid_layer_pattern")
    if pattern is not None and list(pattern) != [int(t == SLIDING) for t in types]:
        raise _refuse("hybrid_layer_pattern", pattern, f"transformers ignores it and uses layer_types {types}")
    return types


def _mlp_types(hf: dict[str, Any], n: int) -> tuple[bool, ...]:
    types = hf.get("mlp_layer_types")
    if types is None:  # transformers' default: the first layer dense, the rest sparse
        types = ["dense"] + ["sparse"] * (n - 1)
    types = list(types)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise _refuse("mlp_layer_types", types, f"it must name {n} layers as 'dense' or 'sparse'")
    freq = hf.get("moe_layer_freq")
    if isinstance(freq, list) and freq != [int(t == "sparse") for t in types]:
        raise _refuse("moe_layer_freq", freq, f"transformers ignores it and uses mlp_layer_types {types}")
    return tuple(t == "sparse" for t in types)


def _rope(hf: dict[str, Any], kind: str, head_dim: int) -> RopeSpec:
    given = hf.get("rope_parameters")
    if given is not None and not isinstance(given.get(kind), dict):
        raise _refuse("rope_parameters", given, f"transformers reads one dict per layer type ({kind} missing)")
    params = (given or _ROPE_DEFAULTS)[kind]
    if (params.get("rope_type") or "default") != "default":
        raise _refuse(f"rope_parameters.{kind}.rope_type", params["rope_type"], "only default rotary is implemented")
    theta = float(params.get("rope_theta") or 10000.0)
    factor = float(params.get("partial_rotary_factor", 0.334))
    if given is None:  # the hub's flat spellings, which transformers ignores in favour of its defaults
        for field, value in (
            (("rope_theta" if kind == FULL else "swa_rope_theta"), theta),
            ("partial_rotary_factor", factor),
        ):
            if field in hf and float(hf[field]) != value:
                raise _refuse(
                    field,
                    hf[field],
                    f"transformers ignores it and uses {value!r} on {kind} layers "
                    "(give rope_parameters per layer type)",
                )
    spec = RopeSpec(theta, int(head_dim * factor))
    if not 0 < 2 * spec.pairs <= head_dim:
        raise _refuse(
            f"rope_parameters.{kind}.partial_rotary_factor", factor, f"it rotates {2 * spec.pairs} of {head_dim} dims"
        )
    return spec


# The fields read as they stand in config.json (with transformers' MiMoV2Config defaults).
_FIELDS = Fields(
    MiMoV2Config,
    vocab_size=152576,
    hidden_size=4096,
    intermediate_size=16384,
    rms_norm_eps=_TRANSFORMERS_DEFAULTS["rms_norm_eps"],
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    moe_intermediate_size=2048,
)


def config_from_hf(hf: dict[str, Any]) -> MiMoV2Config:
    """Read a Hugging Face config.json dict, in transformers' spellings or the hub's (which must
    agree with what transformers computes from it); unsupported variants raise ValueError."""
    _check_supported(hf)
    n = int(hf.get("num_hidden_layers", 48))
    heads, kv = int(_get(hf, "num_attention_heads")), int(_get(hf, "num_key_value_heads"))
    if heads % (2 * kv):
        raise _refuse("num_key_value_heads", kv, f"sliding layers' {2 * kv} kv heads must divide {heads} query heads")
    head_dim, v_head_dim = int(_get(hf, "head_dim")), int(_get(hf, "v_head_dim"))
    types = _layer_types(hf, n)
    window = (
        int(hf["sliding_window_size"]) + 1
        if hf.get("sliding_window_size") is not None
        else hf.get("sliding_window", 129)
    )
    if window is None or int(window) < 1:
        raise _refuse("sliding_window", window, "sliding layers need a window of at least one key")
    mtp = int(hf.get("num_nextn_predict_layers") or 0)
    scale = hf.get("attention_value_scale", 0.707)
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 256)
    scaling = hf.get("routed_scaling_factor")
    top_k = int(hf.get("num_experts_per_tok", 8))
    router = grouped_sigmoid_router(hf, experts, top_k, 1.0 if scaling is None else float(scaling))
    return MiMoV2Config(
        **_FIELDS.read(hf),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types),
        layer_sparse=_mlp_types(hf, n),
        rope_full=_rope(hf, FULL, head_dim),
        rope_sliding=_rope(hf, SLIDING, head_dim),
        value_scale=1.0 if scale is None else float(scale),
        router=router,
        num_mtp_layers=mtp,
        sliding_window=int(window),
    )


def ignored_tensor(config: MiMoV2Config, name: str) -> bool:
    """MTP layers beyond num_nextn_predict_layers (transformers loads none of them)."""
    match = _MTP_NAME.match(name)
    return match is not None and int(match.group(1)) >= config.num_mtp_layers


def kv_shape(config: MiMoV2Config) -> tuple[int, int, int]:
    """(num_layers, kv heads, head_dim + v_head_dim): one packed key|value tensor per layer (SHARED_KV)."""
    return config.num_layers, config.cache_heads, config.row_width


def window_pool(config: MiMoV2Config) -> tuple[int, tuple[int, ...]] | None:
    """The sliding main layers' packed caches in a second page pool (KvLayout.window_pool), freed
    behind the window by helios; the MTP layers' caches (sliding too) stay in the main pool, where
    the drafter's scratch pages are. None without sliding layers."""
    windows = config.layer_windows
    if not any(windows):
        return None
    return max(windows), tuple(i for i, w in enumerate(windows) if w > 0)


def extra_caches(config: MiMoV2Config) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """The MTP layers' own packed KV, on the step's pages (numbered after the main layers)."""
    if not config.num_mtp_layers:
        return ()
    layers = tuple(range(config.num_layers, config.num_layers + config.num_mtp_layers))
    return ((mtp.MTP_CACHE, layers, config.cache_heads, config.row_width),)


def decode_weight_bytes(config: MiMoV2Config, weights: dict[str, Tensor]) -> int:
    """Weights one decode step reads: the main model's (top-k experts per MoE layer), no MTP layer."""
    main = {name: t for name, t in weights.items() if not name.startswith("mtp.")}
    return moe.decode_weight_bytes(config, main, config.router.top_k)
