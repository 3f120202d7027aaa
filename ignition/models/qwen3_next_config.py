"""The Qwen3-Next / Qwen3.5 family's checkpoint side: weight-name maps, the frozen config read from
config.json, and the cache layout it implies (paged KV, gated DeltaNet state slots, MTP hidden states).

The step program, MTP drafter and test checkpoints are in ignition.models.qwen3_next; the reference
forward in ignition.models.qwen3_next_reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from helios.core.manifest import TensorSpec
from ignition.models import moe, mtp
from ignition.models.common import ATTENTION_WEIGHT_MAP, QK_NORM_WEIGHT_MAP, SWIGLU_WEIGHT_MAP, DecoderFields
from ignition.models.hf_config import REQUIRED, AttentionHeads, Fields, Key
from ignition.models.naming import with_prefixes

NAME = "qwen3_next"
HF_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
HF_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

# Exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

LINEAR, FULL = "linear_attention", "full_attention"

# Which reference each model type follows: (projection layout grouped per key head, every layer MoE).
_VARIANTS = {
    "qwen3_next": ("qwen3_next", True),
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_text": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5_moe", False),
    "qwen3_5_moe_text": ("qwen3_5_moe", False),
}

_L = "model.layers.{}."
_TEXT_WEIGHT_MAP = {
    # gated full attention (q_proj rows: per head, head_dim query rows then head_dim gate rows)
    **ATTENTION_WEIGHT_MAP,
    **QK_NORM_WEIGHT_MAP,
    # gated DeltaNet: Qwen3-Next's fused projections (grouped per key head), kept as they are ...
    _L + "linear_attn.in_proj_qkvz.weight": "layers.{}.wqkvz",
    _L + "linear_attn.in_proj_ba.weight": "layers.{}.wba",
    # ... or Qwen3.5's separate ones, fused below into the same names in the flat layout
    _L + "linear_attn.in_proj_qkv.weight": "layers.{}.w_qkv",
    _L + "linear_attn.in_proj_z.weight": "layers.{}.w_z",
    _L + "linear_attn.in_proj_b.weight": "layers.{}.w_b",
    _L + "linear_attn.in_proj_a.weight": "layers.{}.w_a",
    _L + "linear_attn.conv1d.weight": "layers.{}.conv",  # [C, 1, K]
    _L + "linear_attn.dt_bias": "layers.{}.dt_bias",
    _L + "linear_attn.A_log": "layers.{}.a_log",
    _L + "linear_attn.norm.weight": "layers.{}.gated_norm",
    _L + "linear_attn.out_proj.weight": "layers.{}.w_out",
    **SWIGLU_WEIGHT_MAP,  # dense MLP
    # MoE: router, experts (per expert or stacked), shared expert and its gate
    **moe.expert_weight_map(),
    **moe.shared_expert_weight_map(name="shared_expert"),
    _L + "mlp.shared_expert_gate.weight": "layers.{}.w_shared_expert_gate",
}

# The multimodal checkpoints (Qwen3_5ForConditionalGeneration) keep the text model under model.language_model.
_TEXT_PREFIX, _MULTIMODAL_PREFIX = "model.", "model.language_model."
# MTP layer N's decoder tensors (top-level `mtp.layers.N.`, in text and multimodal checkpoints alike)
# become "mtp.N.*", named as a main layer's otherwise; the tensors the MTP layers share are "mtp.*".
_MTP_LAYER = "mtp.layers.{}."
_MTP_WEIGHT_MAP = {
    "mtp.fc.weight": "mtp.fc",
    "mtp.pre_fc_norm_embedding.weight": "mtp.pre_fc_norm_embedding",
    "mtp.pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden",
    "mtp.norm.weight": "mtp.norm",
    **{
        _MTP_LAYER + k.removeprefix(_L): "mtp." + v.removeprefix("layers.")
        for k, v in _TEXT_WEIGHT_MAP.items()
        if k.startswith(_L) and "linear_attn" not in k
    },
}

WEIGHT_MAP = with_prefixes(_TEXT_WEIGHT_MAP, {_TEXT_PREFIX: (_MULTIMODAL_PREFIX,)}) | _MTP_WEIGHT_MAP


def _mtp_names(table: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The same stacking or fusion for the MTP layers' "mtp.N." names."""
    swap = lambda name: "mtp." + name.removeprefix("layers.")  # noqa: E731
    return {swap(k): tuple(swap(p) for p in parts) for k, parts in table.items()}


STACKED = moe.STACKED_EXPERTS | _mtp_names(moe.STACKED_EXPERTS)

# Each layer holds only its own groups (attention or DeltaNet, dense or MoE); export skips absent ones.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.wqkvz": ("layers.{}.w_qkv", "layers.{}.w_z"),
    "layers.{}.wba": ("layers.{}.w_b", "layers.{}.w_a"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
    **moe.SHARED_EXPERT_FUSED,
}
FUSED |= _mtp_names(
    {k: v for k, v in FUSED.items() if k in ("layers.{}.wqkv", "layers.{}.w_gate_up")} | moe.SHARED_EXPERT_FUSED
)

_VISION_PREFIXES = ("model.visual.", "visual.")
_MTP_PREFIXES = ("mtp.", "model.mtp.")


def canonical_name(name: str) -> str:
    """A text tensor's ForCausalLM name, whichever layout the checkpoint uses."""
    return _TEXT_PREFIX + name.removeprefix(_MULTIMODAL_PREFIX) if name.startswith(_MULTIMODAL_PREFIX) else name


def ignored_tensor(config: Any, name: str) -> bool:
    """The vision tower, and the multi-token-prediction tensors when the config declares no MTP layer
    (or beyond the ones it declares): not part of the core."""
    if name.startswith(_VISION_PREFIXES):
        return True
    if not name.startswith(_MTP_PREFIXES):
        return False
    layers = config.num_mtp_layers
    if not layers:
        return True
    parts = name.split(".")
    return parts[0] == "mtp" and parts[1] == "layers" and int(parts[2]) >= layers


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class Qwen3NextConfig(DecoderFields):
    variant: str  # "qwen3_next", "qwen3_5" or "qwen3_5_moe": the reference followed
    layer_types: tuple[str, ...]  # per layer: LINEAR or FULL
    # gated full attention (DecoderFields' heads, head_dim and rope_theta)
    rotary_dim: int  # leading dims of a head that rotate (head_dim * partial_rotary_factor), even
    # gated DeltaNet
    grouped_projections: bool  # in_proj_qkvz / in_proj_ba grouped per key head (Qwen3-Next)
    linear_num_key_heads: int
    linear_num_value_heads: int  # a multiple of linear_num_key_heads
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel_size: int
    # MLPs
    moe_layers: tuple[bool, ...]  # per layer: routed MoE (else dense SwiGLU)
    intermediate_size: int  # dense layers' width (0 when every layer is MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    num_mtp_layers: int = 0  # MTP layers compiled as mtp_draft.N programs
    mtp_moe: bool = False  # whether the MTP layers' MLP is routed (else dense SwiGLU)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: [q | k | v] of a DeltaNet layer."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def router(self) -> moe.RouterSpec:
        return moe.RouterSpec(self.num_experts, self.num_experts_per_tok, "softmax", self.norm_topk_prob)


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field} {value!r} is not supported by the {NAME} family: {why}")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: the multimodal checkpoints nest it under text_config."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _variant(hf: dict[str, Any]) -> tuple[str, bool]:
    text = text_config(hf)
    for model_type in (text.get("model_type"), hf.get("model_type")):
        if model_type in _VARIANTS:
            return _VARIANTS[model_type]
    archs = set(hf.get("architectures") or [])
    if archs & {"Qwen3NextForCausalLM"}:
        return _VARIANTS["qwen3_next"]
    if archs & {"Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"}:
        return _VARIANTS["qwen3_5_moe"]
    if archs & {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"}:
        return _VARIANTS["qwen3_5"]
    raise ValueError(f"model_type {hf.get('model_type')!r} is not one of the {NAME} family's {HF_MODEL_TYPES}")


def _rope(hf: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """(theta, rotary dims) from transformers 5's rope_parameters or the legacy top-level fields."""
    params = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "mrope"):  # mrope: Qwen-VL's name for the sectioned default rotary
        _refuse("rope_parameters.rope_type", kind, "only the default rotary embedding is implemented")
    factor = float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.25)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        _refuse("partial_rotary_factor", factor, f"head_dim {head_dim} * factor must be a positive even count")
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0), rotary_dim


def _layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {LINEAR, FULL}:
        _refuse("layer_types", types, f"it must name {num_layers} layers as {LINEAR} or {FULL}")
    return tuple(types)


def _check_supported(hf: dict[str, Any]) -> None:
    if hf.get("attention_bias"):
        _refuse("attention_bias", hf["attention_bias"], "the projections have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "only silu (MLPs and the DeltaNet conv) is implemented")
    if hf.get("attn_output_gate", True) is not True:
        _refuse("attn_output_gate", hf["attn_output_gate"], "only the gated attention of the references is implemented")
    if hf.get("use_sliding_window"):
        _refuse("use_sliding_window", hf["use_sliding_window"], "the references' attention is global")
    if hf.get("quantization_config"):
        _refuse(
            "quantization_config", hf["quantization_config"].get("quant_method"), "quantized checkpoints are not read"
        )


def _tied(hf: dict[str, Any]) -> bool:
    text = text_config(hf)
    if text is hf:
        return bool(hf.get("tie_word_embeddings", False))
    top, inner = hf.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if top is not None and inner is not None and bool(top) != bool(inner):
        _refuse(
            "text_config.tie_word_embeddings", inner, f"it disagrees with the top-level tie_word_embeddings {top!r}"
        )
    return bool(top if top is not None else inner)


def _mlp_fields(hf: dict[str, Any], variant: str, num_layers: int) -> dict[str, Any]:
    if variant == "qwen3_5":
        return {"moe_layers": (False,) * num_layers, "intermediate_size": int(hf["intermediate_size"])}
    experts = int(hf.get("num_experts") or 0)
    if variant == "qwen3_5_moe":
        moe_layers = (True,) * num_layers
        norm_topk = True  # Qwen3_5MoeTopKRouter always renormalizes (the config field does not exist)
    else:  # Qwen3NextDecoderLayer: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        norm_topk = bool(hf.get("norm_topk_prob", True))
    dense_width = 0 if all(moe_layers) else int(hf["intermediate_size"])
    fields: dict[str, Any] = {"moe_layers": moe_layers, "intermediate_size": dense_width}
    if any(moe_layers):
        top_k = int(hf["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            _refuse("num_experts_per_tok", top_k, f"it must be between 1 and num_experts {experts}")
        fields |= {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "norm_topk_prob": norm_topk,
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(hf["shared_expert_intermediate_size"]),
        }
        if fields["shared_expert_intermediate_size"] <= 0:
            _refuse(
                "shared_expert_intermediate_size",
                fields["shared_expert_intermediate_size"],
                "the references' MoE blocks always have a shared expert",
            )
    return fields


# The fields read as they stand in the text config; the references' defaults for the optional ones.
_FIELDS = Fields(
    Qwen3NextConfig,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    linear_key_head_dim=REQUIRED,
    linear_value_head_dim=REQUIRED,
    conv_kernel_size=Key("linear_conv_kernel_dim", 4),
)


def config_from_hf(hf: dict[str, Any]) -> Qwen3NextConfig:
    """Read a Hugging Face config.json dict (flat, or a multimodal one's text_config); unsupported
    variants raise ValueError naming the field."""
    variant, grouped = _variant(hf)
    tied = _tied(hf)
    text = text_config(hf)
    _check_supported(text)
    heads = AttentionHeads.from_hf(text)
    theta, rotary_dim = _rope(text, heads.head_dim)
    num_layers = int(text["num_hidden_layers"])
    k_heads, v_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    if v_heads % k_heads:
        _refuse("linear_num_value_heads", v_heads, f"it must be a multiple of linear_num_key_heads {k_heads}")
    return Qwen3NextConfig(
        **_FIELDS.read(text),
        **heads._asdict(),
        variant=variant,
        num_layers=num_layers,
        layer_types=_layer_types(text, num_layers),
        tie_word_embeddings=tied,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        grouped_projections=grouped,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        **_mlp_fields(text, variant, num_layers),
        **_mtp_fields(text, variant),
    )


def _mtp_fields(hf: dict[str, Any], variant: str) -> dict[str, Any]:
    """MTP layers the config declares (Qwen3.5's mtp_num_hidden_layers; vLLM's num_nextn_predict_layers),
    and whether their MLP is routed: as a main layer of the same index would be (vLLM builds MTP
    layer N as decoder layer N), always for Qwen3.5-MoE, never for dense Qwen3.5."""
    layers = int(hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0)
    if layers and hf.get("mtp_use_dedicated_embeddings"):
        _refuse("mtp_use_dedicated_embeddings", True, "the MTP layers share the main model's embedding here")
    if variant == "qwen3_5":
        routed = False
    elif variant == "qwen3_5_moe":
        routed = True
    else:
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        routed = 0 not in dense and int(hf.get("num_experts") or 0) > 0 and 1 % step == 0
    return {"num_mtp_layers": layers, "mtp_moe": routed and layers > 0}


def kv_shape(config: Qwen3NextConfig) -> tuple[int, int, int]:
    """Paged KV for every layer (the DeltaNet layers never touch theirs; recurrent-state contract)."""
    return config.num_layers, config.num_kv_heads, config.head_dim


def extra_caches(config: Qwen3NextConfig) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """The MTP layers' keys, then their values, on the step's pages (numbered after the main layers)."""
    if not config.num_mtp_layers:
        return ()
    layers = tuple(range(config.num_layers, config.num_layers + config.num_mtp_layers))
    return tuple((mtp.MTP_CACHE, layers, config.num_kv_heads, config.head_dim) for _ in range(2))


def extra_step_outputs(config: Qwen3NextConfig) -> tuple[TensorSpec, ...]:
    """Outputs the step programs return after program_signature's: the drafter's input, with MTP layers."""
    return mtp.extra_step_outputs(config.hidden_size, config.num_mtp_layers)


StateCaches = tuple[tuple[str, tuple[int, ...], tuple[int, ...], str], ...]


def linear_attention_states(
    layers: tuple[int, ...], conv_dim: int, conv_kernel_size: int, heads: int, key_dim: int, value_dim: int
) -> StateCaches:
    """Per-sequence state of delta-rule linear-attention layers (gated DeltaNet, GLM-5.3's KDA), fp32:
    the short conv's last K - 1 inputs [conv_dim, K - 1] and the delta-rule state [heads, key_dim, value_dim]."""
    return (
        ("conv", layers, (conv_dim, conv_kernel_size - 1), "float32"),
        ("recurrent", layers, (heads, key_dim, value_dim), "float32"),
    )


def state_caches(config: Qwen3NextConfig) -> StateCaches:
    """The DeltaNet layers' conv inputs and delta-rule states."""
    c = config
    heads, key_dim, value_dim = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    return linear_attention_states(c.linear_layers, c.conv_dim, c.conv_kernel_size, heads, key_dim, value_dim)


def decode_weight_bytes(config: Qwen3NextConfig, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per MoE layer (no MTP layer)."""
    main = {name: t for name, t in weights.items() if not name.startswith("mtp.")}
    return moe.decode_weight_bytes(config, main, config.num_experts_per_tok)
