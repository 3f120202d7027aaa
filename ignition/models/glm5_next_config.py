"""The GLM-5.3-Flash (glm5_next) family's checkpoint side: weight-name maps, the frozen config read
from config.json, and the cache layout it implies (MLA latent pages, indexer keys, KDA state slots).

The step program and test checkpoints are in ignition.models.glm5_next; the reference forward in
ignition.models.glm5_next_reference."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ignition.models import glm5_next_vision, moe
from ignition.models.common import HEAD_WEIGHT_MAP, PRE_NORM_WEIGHT_MAP, SWIGLU_WEIGHT_MAP, hyper_weight_map
from ignition.models.glm_moe_dsa import _indexer_types, glm_router
from ignition.models.hf_config import Fields, Key
from ignition.models.naming import with_prefixes
from ignition.models.qwen3_next_config import StateCaches, linear_attention_states

NAME = "glm5_next"
HF_ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
HF_MODEL_TYPES = ("glm5_next", "glm5_next_text")

# Exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

SHARED_KV = True  # one latent row per token and layer (the KDA layers never touch theirs)
INDEXER_CACHE = "indexer_kg"  # per position of a full indexer layer: [indexer key | its gate logits]
LINEAR, INDEXED = "linear_attention", "indexed_attention"
DENSE, SPARSE = "dense", "sparse"

_TEXT_PREFIX, _FLAT_PREFIX = "model.language_model.", "model."
_L = "model.layers.{}."
_A = _L + "self_attn."
_I = _A + "indexer."
# The flat text layout's names (model.*); WEIGHT_MAP adds the multimodal layout's (model.language_model.*).
_TEXT_WEIGHT_MAP = {
    **HEAD_WEIGHT_MAP,
    **PRE_NORM_WEIGHT_MAP,
    **hyper_weight_map(_L + "{block}_hc.{part}"),
    **hyper_weight_map(_L + "hc_{block}_{part}"),  # GLM's own names (transformers renames them at load)
    # KDA
    _A + "q_proj.weight": "layers.{}.wq",
    _A + "k_proj.weight": "layers.{}.wk",
    _A + "v_proj.weight": "layers.{}.wv",
    _A + "conv1d.weight": "layers.{}.conv",  # [3 * qkv, 1, K]
    _A + "q_conv1d.weight": "layers.{}.conv_q",  # GLM's own per-part convs, concatenated below
    _A + "k_conv1d.weight": "layers.{}.conv_k",
    _A + "v_conv1d.weight": "layers.{}.conv_v",
    _A + "forget_gate.f_a_proj.weight": "layers.{}.f_a",
    _A + "forget_gate.f_b_proj.weight": "layers.{}.f_b",
    _A + "forget_gate.dt_bias": "layers.{}.dt_bias",
    _A + "forget_gate.A_log": "layers.{}.a_log",
    _A + "f_a_proj.weight": "layers.{}.f_a",
    _A + "f_b_proj.weight": "layers.{}.f_b",
    _A + "dt_bias": "layers.{}.dt_bias",
    _A + "A_log": "layers.{}.a_log",
    _A + "b_proj.weight": "layers.{}.w_beta",
    _A + "g_a_proj.weight": "layers.{}.g_a",
    _A + "g_b_proj.weight": "layers.{}.g_b",
    _A + "o_norm.weight": "layers.{}.o_norm",
    _A + "o_proj.weight": "layers.{}.wo",  # KDA's and MLA's output projection
    # NoPE MLA
    _A + "q_a_proj.weight": "layers.{}.wq_a",
    _A + "q_a_layernorm.weight": "layers.{}.q_a_norm",
    _A + "q_b_proj.weight": "layers.{}.wq_b",
    _A + "kv_a_proj_with_mqa.weight": "layers.{}.wkv_a",
    _A + "kv_a_layernorm.weight": "layers.{}.kv_a_norm",
    _A + "kv_b_proj.weight": "layers.{}.wkv_b",
    # k-pool indexer
    _I + "wq_b.weight": "layers.{}.idx_wq_b",
    _I + "wk.weight": "layers.{}.idx_wk",
    _I + "k_norm.weight": "layers.{}.idx_k_norm",
    _I + "k_norm.bias": "layers.{}.idx_k_norm_bias",
    _I + "weights_proj.weight": "layers.{}.idx_weights_proj",
    _I + "index_kpool_compress_ape": "layers.{}.idx_ape",
    _I + "index_kpool_compress_gate": "layers.{}.idx_gate",
    **SWIGLU_WEIGHT_MAP,  # dense MLP
    # MoE (per-expert or stacked experts) and the shared experts
    **moe.expert_weight_map(),
    **moe.shared_expert_weight_map(),
}
WEIGHT_MAP = with_prefixes(_TEXT_WEIGHT_MAP, {_FLAT_PREFIX: (_TEXT_PREFIX,)}) | glm5_next_vision.WEIGHT_MAP
STACKED = moe.STACKED_EXPERTS
# Each layer holds only its own groups (KDA or MLA, full indexer or not, dense or MoE).
FUSED = {
    "layers.{}.w_qkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.conv": ("layers.{}.conv_q", "layers.{}.conv_k", "layers.{}.conv_v"),
    "layers.{}.idx_wk_gate": ("layers.{}.idx_wk", "layers.{}.idx_gate"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
    **moe.SHARED_EXPERT_FUSED,
}

_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
_LAYER = re.compile(r"^(?:model\.language_model\.|model\.)layers\.(\d+)\.")


def ignored_tensor(config: Glm5NextConfig, name: str) -> bool:
    """The vision tower of a text-only config and the multi-token-prediction layers (past
    num_hidden_layers, shared_head)."""
    if name.startswith(_VISION_PREFIXES):  # a stored rotary buffer is recomputed, not read
        return config.vision is None or ".rotary_pos_emb." in name
    if ".shared_head." in name:
        return True
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_layers


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class Glm5NextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: LINEAR (KDA) or INDEXED (MLA + DSA)
    mlp_layer_types: tuple[str, ...]  # per layer: DENSE or SPARSE
    indexer_types: tuple[str, ...]  # per layer: "full" runs the indexer, "shared" reuses the previous layer's
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # NoPE MLA (names as ignition.models.deepseek_v3's config, whose absorbed attention is reused)
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # k-pool indexer
    index_topk: int  # positions kept per query by the pools (index_topk / index_kpool pools)
    index_n_heads: int
    index_head_dim: int
    index_kpool: int
    index_tail: bool  # index_kpool_always_select_tail
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel_size: int
    linear_lower_bound: float | None  # None: -exp(A_log) * softplus gate
    # hyper-connections
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MLPs
    intermediate_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    activation: moe.ExpertActivation  # SwiGLU clamped at swiglu_limit (dense, routed and shared)
    router: moe.RouterSpec

    qk_rope_head_dim: int = 0  # NoPE (refused otherwise)
    vision: glm5_next_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint
    num_mtp_layers: int = 0  # none compiled (the MLA step program and shapes it shares with kimi_k3 read it)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim

    @property
    def moe_block(self) -> moe.MoeBlock:
        """The MoE layers: clamped SwiGLU experts, with the shared expert where the checkpoint has one."""
        return moe.MoeBlock(self.router, self.activation, shared=self.n_shared_experts > 0)

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Indexed layers with their own indexer, in order (one indexer cache tensor each)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED and self.indexer_types[i] == "full")

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field} {value!r} is not supported by the {NAME} family: {why}")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: nested under text_config, or (flat checkpoints) the top level."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _tied(hf: dict[str, Any], text: dict[str, Any]) -> bool:
    top, inner = hf.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if text is not hf and top is not None and inner is not None and bool(top) != bool(inner):
        _refuse(
            "text_config.tie_word_embeddings", inner, f"it disagrees with the top-level tie_word_embeddings {top!r}"
        )
    return bool(top if top is not None else inner)


def _check_supported(text: dict[str, Any]) -> None:
    if text.get("attention_bias"):
        _refuse("attention_bias", text["attention_bias"], "the projections have no bias")
    if text.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", text["hidden_act"], "only silu (MLPs and the KDA conv) is implemented")
    if text.get("quantization_config"):
        _refuse(
            "quantization_config", text["quantization_config"].get("quant_method"), "quantized checkpoints are not read"
        )
    if int(text.get("qk_rope_head_dim") or 0) != 0:
        _refuse("qk_rope_head_dim", text["qk_rope_head_dim"], "GLM-5.3-Flash's DSA layers are NoPE (0)")
    if text.get("q_lora_rank", 1536) is None:
        _refuse("q_lora_rank", None, "the indexer reads the q LoRA")
    heads = int(text.get("num_attention_heads", 64))
    if int(text.get("num_key_value_heads") or heads) != heads:
        _refuse("num_key_value_heads", text["num_key_value_heads"], f"it must equal num_attention_heads {heads}")


def _schedules(text: dict[str, Any], layers: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(layer_types, mlp_layer_types, indexer_types) as Glm5NextTextConfig.__post_init__ derives them."""
    kinds = text.get("layer_types") or [LINEAR if i % 4 != 3 else INDEXED for i in range(layers)]
    kinds = tuple(INDEXED if k == "full_attention" else k for k in kinds)
    if len(kinds) != layers or set(kinds) - {LINEAR, INDEXED}:
        _refuse("layer_types", list(kinds), f"it must name {layers} layers as {LINEAR} or {INDEXED}")
    mlps = tuple(text.get("mlp_layer_types") or [DENSE] * min(3, layers) + [SPARSE] * (layers - min(3, layers)))
    if len(mlps) != layers or set(mlps) - {DENSE, SPARSE}:
        _refuse("mlp_layer_types", list(mlps), f"it must name {layers} layers as {DENSE} or {SPARSE}")
    indexers = _indexer_types(text, layers)
    if len(indexers) != layers or set(indexers) - {"full", "shared"}:
        _refuse("indexer_types", list(indexers), f"it must name 'full' or 'shared' for each of the {layers} layers")
    for i, kind in enumerate(kinds):
        # transformers hands a layer's selection only to the very next layer (Glm5NextTextAttention.next_skip_topk)
        if (
            kind == INDEXED
            and indexers[i] == "shared"
            and (i == 0 or kinds[i - 1] != INDEXED or indexers[i - 1] != "full")
        ):
            _refuse("indexer_types", list(indexers), f"shared layer {i} must follow a full indexed_attention layer")
    return kinds, mlps, indexers


def _linear_fields(text: dict[str, Any]) -> dict[str, Any]:
    """KDA sizes, from the flat fields or (GLM's own configs) linear_attn_config, as transformers reads them."""
    fields = {
        "linear_head_dim": int(text.get("linear_head_dim", 128)),
        "linear_num_heads": int(text.get("linear_num_heads", 64)),
        "conv_kernel_size": int(text.get("linear_conv_kernel_dim", 4)),
        "linear_lower_bound": text.get("linear_lower_bound", -5.0),
    }
    nested = text.get("linear_attn_config")
    if isinstance(nested, dict):
        fields["linear_head_dim"] = int(nested.get("head_dim", fields["linear_head_dim"]))
        fields["linear_num_heads"] = int(nested.get("num_heads", fields["linear_num_heads"]))
        fields["conv_kernel_size"] = int(nested.get("short_conv_kernel_size", fields["conv_kernel_size"]))
        fields["linear_lower_bound"] = nested.get("gate_lower_bound", fields["linear_lower_bound"])
        if nested.get("safe_gate", True) and fields["linear_lower_bound"] is None:
            fields["linear_lower_bound"] = -5.0
    if fields["linear_lower_bound"] is not None:
        fields["linear_lower_bound"] = float(fields["linear_lower_bound"])
    if fields["conv_kernel_size"] < 2:
        _refuse("linear_conv_kernel_dim", fields["conv_kernel_size"], "the short conv needs a kernel of at least 2")
    return fields


# The fields read as they stand in the text config (with Glm5NextTextConfig's defaults).
_FIELDS = Fields(
    Glm5NextConfig,
    vocab_size=154880,
    hidden_size=4096,
    rms_norm_eps=1e-5,
    max_position_embeddings=1048576,
    num_heads=Key("num_attention_heads", 64),
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_tail=Key("index_kpool_always_select_tail", True),
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    intermediate_size=12288,
    moe_intermediate_size=2048,
)


def config_from_hf(hf: dict[str, Any]) -> Glm5NextConfig:
    """Read a Hugging Face config.json dict (text_config nested or flat); unsupported variants raise
    ValueError naming the field."""
    text = text_config(hf)
    tied = _tied(hf, text)
    _check_supported(text)
    layers = int(text.get("num_hidden_layers", 45))
    kinds, mlps, indexers = _schedules(text, layers)
    kpool, topk = int(text.get("index_kpool", 16)), int(text.get("index_topk", 2048))
    if kpool < 1:
        _refuse("index_kpool", kpool, "it must be positive")
    if topk < kpool or topk % kpool:
        _refuse("index_topk", topk, f"it must be a positive multiple of index_kpool {kpool}")
    if not text.get("index_kpool_always_select_tail", True) and kpool > 1:
        # Without the tail a query before its first complete pool keeps no position; transformers then
        # softmaxes over an all-masked row (every position, future ones too, at equal weight).
        _refuse("index_kpool_always_select_tail", False, "the first index_kpool - 1 positions would attend to nothing")
    limit = float(text.get("swiglu_limit", 10.0) or 0.0)
    if limit <= 0:
        _refuse("swiglu_limit", limit, "the SwiGLU clamp must be positive")
    router = glm_router(text, default_experts=288)
    return Glm5NextConfig(
        **_FIELDS.read(text),
        num_layers=layers,
        layer_types=kinds,
        mlp_layer_types=mlps,
        indexer_types=indexers,
        tie_word_embeddings=tied,
        index_topk=topk,
        index_kpool=kpool,
        **_linear_fields(text),
        n_shared_experts=int(text.get("n_shared_experts", 1) or 0),
        activation=moe.ExpertActivation("silu", limit=limit),
        router=router,
        vision=glm5_next_vision.config_from_hf(hf, text) if _multimodal(hf, text) else None,
    )


def _multimodal(hf: dict[str, Any], text: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config and an image token id (image_token_id, else
    Glm5NextConfig's default) inside the text vocabulary."""
    if not isinstance(hf.get("vision_config"), dict):
        return False
    return 0 <= glm5_next_vision.image_token_id(hf) < int(text.get("vocab_size", 154880))


def kv_shape(config: Glm5NextConfig) -> tuple[int, int, int]:
    """(num_layers, 1, kv_lora_rank): one NoPE latent row per token (SHARED_KV); KDA layers leave theirs unused."""
    return config.num_layers, 1, config.kv_lora_rank


def extra_caches(config: Glm5NextConfig) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """Per position of each full indexer layer: its indexer key and gate logits [2 * index_head_dim]."""
    return ((INDEXER_CACHE, config.indexer_layers, 1, 2 * config.index_head_dim),)


def state_caches(config: Glm5NextConfig) -> StateCaches:
    """The KDA layers' conv inputs and delta-rule states (Qwen3-Next's layout)."""
    c = config
    return linear_attention_states(
        c.linear_layers, c.conv_dim, c.conv_kernel_size, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim
    )


def decode_weight_bytes(config: Glm5NextConfig, weights: dict[str, Tensor]) -> int:
    text = {k: v for k, v in weights.items() if not k.startswith("vision.")}  # the tower runs per image, not per step
    return moe.decode_weight_bytes(config, text, config.router.top_k)
