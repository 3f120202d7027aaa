"""The DeepSeek-V3 / Kimi K2 / K2.5 (kimi_k3) family's checkpoint side: weight-name maps (text, MTP
and the Kimi K2.5 vision tower), the frozen config read from config.json, and the cache layout it
implies (one MLA latent row per token, MTP hidden states).

The step program, MTP drafter, reference forward and test checkpoints are in ignition.models.deepseek_v3."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from helios.core.manifest import TensorSpec
from ignition.models import kimi_k25_vision, moe, mtp
from ignition.models.common import HEAD_WEIGHT_MAP, PRE_NORM_WEIGHT_MAP
from ignition.models.hf_config import REQUIRED, Fields, Key, grouped_sigmoid_router
from ignition.models.kimi_k25_vision import TESTMODEL_PROCESSOR, TESTMODEL_VISION_TOKENS, testmodel_vision  # noqa: F401
from ignition.models.naming import refuse_vision_tensors, with_prefixes, without_prefixes

NAME = "kimi_k3"
HF_ARCHITECTURES = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")
HF_MODEL_TYPES = ("deepseek_v3", "kimi_k25", "kimi_k2")

# The paged cache is one latent tensor per layer, read as keys and values (KvLayout.shared_kv).
SHARED_KV = True

# q_a_layernorm / kv_a_layernorm are built without the config's eps (DeepSeek's RMSNorm default).
LATENT_NORM_EPS = 1e-6

# Hugging Face checkpoint name (DeepseekV3ForCausalLM layout) -> internal name.
_TEXT_WEIGHT_MAP = {
    **HEAD_WEIGHT_MAP,
    **PRE_NORM_WEIGHT_MAP,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.wq",  # q_lora_rank None
    "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.wq_a",
    "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.q_a_norm",
    "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.wq_b",
    "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.wkv_a",
    "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.kv_a_norm",
    "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.wkv_b",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.wo",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",  # dense layers
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
    **moe.expert_weight_map(),
    **moe.shared_expert_weight_map(),
}

# Where Kimi K2.5-style multimodal checkpoints keep the text model: Moonshot's own layout and
# transformers' Kimi_K25ForConditionalGeneration (conversion_mapping "kimi_k25").
_TEXT_PREFIXES = {
    "model.": ("language_model.model.", "model.language_model."),
    "lm_head.": ("language_model.lm_head.",),
}


# An MTP layer's own tensors (layer numbers from num_hidden_layers on; its decoder layer is named as any other).
_MTP_WEIGHT_MAP = {
    "model.layers.{}.enorm.weight": "layers.{}.enorm",
    "model.layers.{}.hnorm.weight": "layers.{}.hnorm",
    "model.layers.{}.eh_proj.weight": "layers.{}.eh_proj",
    "model.layers.{}.shared_head.norm.weight": "layers.{}.head_norm",
    "model.layers.{}.shared_head.head.weight": "layers.{}.head",  # optional: else the main lm_head
    "model.layers.{}.embed_tokens.weight": "layers.{}.embed",  # optional: else the main embedding
}

WEIGHT_MAP = with_prefixes(_TEXT_WEIGHT_MAP | _MTP_WEIGHT_MAP, _TEXT_PREFIXES) | kimi_k25_vision.WEIGHT_MAP
TEXT_WEIGHT_MAP = _TEXT_WEIGHT_MAP  # DeepseekV3ForCausalLM's own layout (glm_moe_dsa builds on it)

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_INTERNAL_LAYER = re.compile(r"^layers\.(\d+)\.")

STACKED = moe.STACKED_EXPERTS

# Dense and MoE layers each lack the other's group; export skips a group absent from a layer.
FUSED = {"layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"), **moe.SHARED_EXPERT_FUSED}


def canonical_name(name: str) -> str:
    """A text tensor's DeepseekV3ForCausalLM name, whichever layout the checkpoint uses."""
    return without_prefixes(name, _TEXT_PREFIXES)


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """DeepSeek's rotary embedding over the qk_rope_head_dim dims: plain, or YaRN (factor > 1)."""

    theta: float
    dim: int  # qk_rope_head_dim
    interleave: bool  # rotary pairs are (x0, x1), (x2, x3)... (DeepSeek's layout) rather than halves
    yarn: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent
    mscale_all_dim: float = 0.0  # 0: absent
    attention_factor: float | None = None  # cos/sin multiplier; None: from factor and mscales
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's attention factor, applied to cos and sin (1.0 for DeepSeek-V3, whose mscales match)."""
        if not self.yarn:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The softmax scale's correction: mscale(factor, mscale_all_dim) squared (yarn_apply_mscale)."""
        if not self.yarn or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def correction_range(self) -> tuple[float, float]:
        """YaRN's ramp bounds over the rotary pair index."""

        def dim_at(rotations: float) -> float:
            positions = self.original_max_position_embeddings
            return self.dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_at(self.beta_fast), dim_at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        return low, (high + 0.001 if low == high else high)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' SwiGLU width
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int  # latent width r of the cache
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    first_k_dense_replace: int  # layers [0, k) have a dense MLP, the rest MoE
    moe_intermediate_size: int  # each expert's SwiGLU width
    n_shared_experts: int  # the shared expert is n_shared_experts * moe_intermediate_size wide; 0: none
    router: moe.RouterSpec
    num_mtp_layers: int  # num_nextn_predict_layers: layers num_layers.. compiled as mtp_draft.N programs
    # The vision tower of a multimodal (Kimi K2.5) checkpoint; keyword-only so subclasses' fields may follow.
    vision: kimi_k25_vision.VisionConfig | None = field(default=None, kw_only=True)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_block(self) -> moe.MoeBlock:
        """The MoE layers: SwiGLU experts, with the shared expert where the checkpoint has one."""
        return moe.MoeBlock(self.router, shared=self.n_shared_experts > 0)

    @property
    def latent_dim(self) -> int:
        """One cache row: normed c_kv [kv_lora_rank] then rotated k_pe [qk_rope_head_dim]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: Kimi K2.5-style checkpoints nest it under text_config."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def rope_from_hf(hf: dict[str, Any], family: str = NAME, interleave: bool | None = None) -> RopeSpec:
    """Plain or YaRN rotary from `rope_parameters` (transformers 5) or legacy `rope_scaling`;
    `interleave` None follows the config's `rope_interleave` (GLM-5 always interleaves)."""
    params = dict(hf.get("rope_scaling") or {}) | dict(hf.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    dim = int(hf["qk_rope_head_dim"])
    interleave = bool(hf.get("rope_interleave", True)) if interleave is None else interleave
    if kind == "default":
        return RopeSpec(theta=theta, dim=dim, interleave=interleave)
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported by the {family} family (supported: default, yarn)")
    return yarn_rope(params, theta, dim, interleave, int(hf["max_position_embeddings"]))


def yarn_rope(params: dict[str, Any], theta: float, dim: int, interleave: bool, max_positions: int) -> RopeSpec:
    """YaRN rotary from transformers' rope_parameters (factor: max_positions over the original's where unset)."""
    original = int(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")  # None: YaRN's own mscale
    return RopeSpec(
        theta=theta,
        dim=dim,
        interleave=interleave,
        yarn=True,
        factor=float(params.get("factor") or max_positions / original),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _check_supported(hf: dict[str, Any]) -> None:
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias is not supported by the {NAME} family")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported by the {NAME} family")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"only sigmoid noaux_tc routing is supported by the {NAME} family")
    if hf.get("quantization_config"):
        raise ValueError(f"quantized checkpoints are not supported by the {NAME} family yet")


# The fields read as they stand in the (text) config; DeepseekV3Config's defaults for the optional ones.
_FIELDS = Fields(
    DeepseekV3Config,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    intermediate_size=REQUIRED,
    num_layers=Key("num_hidden_layers"),
    num_heads=Key("num_attention_heads"),
    kv_lora_rank=REQUIRED,
    qk_nope_head_dim=REQUIRED,
    qk_rope_head_dim=REQUIRED,
    v_head_dim=REQUIRED,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    first_k_dense_replace=Key("first_k_dense_replace", 0, or_default=True),
    moe_intermediate_size=REQUIRED,
    n_shared_experts=Key("n_shared_experts", 0, or_default=True),
    num_mtp_layers=Key("num_nextn_predict_layers", 0, or_default=True),
)


def config_from_hf(hf: dict[str, Any]) -> DeepseekV3Config:
    """Read a Hugging Face config.json dict (DeepSeek-V3, or Kimi's with a nested text_config)."""
    tie = bool(text_config(hf).get("tie_word_embeddings", False))
    top, hf = hf, text_config(hf)
    _check_supported(hf)
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts"))
    q_lora = hf.get("q_lora_rank")
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    router = grouped_sigmoid_router(hf, experts, int(hf["num_experts_per_tok"]), scaling)
    return DeepseekV3Config(
        **_FIELDS.read(hf),
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope=rope_from_hf(hf),
        tie_word_embeddings=tie,
        router=router,
        vision=kimi_k25_vision.config_from_hf(top, hf) if _multimodal(top) else None,
    )


def _multimodal(top: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config beside the nested text_config and an image token id
    (image_token_id, else Kimi_K25Config's default) inside the text vocabulary."""
    if not isinstance(top.get("vision_config"), dict) or not isinstance(top.get("text_config"), dict):
        return False
    return 0 <= kimi_k25_vision.image_token_id(top) < int(top["text_config"]["vocab_size"])


def canonical_tensors(config: DeepseekV3Config, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A multimodal checkpoint's vision tensors in transformers' names, whichever layout it ships
    (Moonshot's vision_tower.encoder.blocks.N.* / mm_projector.proj.* or transformers'
    model.vision_tower.*); a text-only config refuses them."""
    if config.vision is None:
        refuse_vision_tensors(tensors, kimi_k25_vision.VISION_PREFIXES)
        return tensors
    return kimi_k25_vision.native_tensors(tensors, config.vision.num_heads)


def kv_shape(config: DeepseekV3Config) -> tuple[int, int, int]:
    """(num_layers, 1, latent_dim): one shared latent row per token (SHARED_KV)."""
    return config.num_layers, 1, config.latent_dim


def ignored_tensor(config: DeepseekV3Config, name: str) -> bool:
    """Layers past the main ones and num_nextn_predict_layers MTP layers (transformers loads neither;
    num_nextn_predict_layers = 0 exports a DeepSeek-V3 checkpoint without its MTP layer)."""
    match = _LAYER_NAME.match(canonical_name(name))
    return match is not None and int(match.group(1)) >= config.num_layers + config.num_mtp_layers


def extra_caches(config: DeepseekV3Config) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """The MTP layers' own latent caches, on the step's pages (numbered after the main layers)."""
    if not config.num_mtp_layers:
        return ()
    return (
        (
            mtp.MTP_CACHE,
            tuple(range(config.num_layers, config.num_layers + config.num_mtp_layers)),
            1,
            config.latent_dim,
        ),
    )


def extra_step_outputs(config: DeepseekV3Config) -> tuple[TensorSpec, ...]:
    """Outputs the step programs return after program_signature's: the drafter's input, with MTP layers."""
    return mtp.extra_step_outputs(config.hidden_size, config.num_mtp_layers)


def _is_mtp_weight(config: Any, name: str) -> bool:
    match = _INTERNAL_LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_layers


def decode_weight_bytes(config: DeepseekV3Config, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per MoE layer (no MTP layer,
    no vision tower)."""
    # The vision tower runs per image, not per decode step.
    main = {n: t for n, t in weights.items() if not _is_mtp_weight(config, n) and not n.startswith("vision.")}
    return moe.decode_weight_bytes(config, main, config.router.top_k)
