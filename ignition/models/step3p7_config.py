"""The Step 3.5 / 3.7 (step5) family's checkpoint side: weight-name maps for StepFun's and the
hub's layouts, the frozen config read from config.json, and the cache layout it implies (paged KV,
sliding layers' pooled windows).

The step program, reference forward and test checkpoints are in ignition.models.step3p7."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ignition.models import moe, step3p7_vision
from ignition.models.common import ATTENTION_WEIGHT_MAP, QK_NORM_WEIGHT_MAP, SWIGLU_WEIGHT_MAP
from ignition.models.gemma3 import FULL, SLIDING
from ignition.models.hf_config import Fields
from ignition.models.naming import with_prefixes

NAME = "step5"
HF_ARCHITECTURES = ("Step3p7ForConditionalGeneration",)
HF_MODEL_TYPES = ("step3p7", "step3p5")  # the multimodal wrapper and its text model (Step-3.5-Flash's own type)

# Exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

_L = "model.layers.{}."
# Checkpoint names (StepFun's layout, which transformers' save_pretrained also writes) -> internal.
_HUB_WEIGHT_MAP = {
    **ATTENTION_WEIGHT_MAP,
    _L + "self_attn.g_proj.weight": "layers.{}.wg",
    **QK_NORM_WEIGHT_MAP,
    **SWIGLU_WEIGHT_MAP,  # dense layers
    _L + "moe.gate.weight": "layers.{}.w_router",
    _L + "moe.router_bias": "layers.{}.router_bias",
    _L + "moe.gate_proj.weight": "layers.{}.moe_gate",  # [E, F, H], stacked into w_experts_gate_up
    _L + "moe.up_proj.weight": "layers.{}.moe_up",
    _L + "moe.down_proj.weight": "layers.{}.w_experts_down",  # [E, H, F]
    **moe.shared_expert_weight_map(_L, "share_expert"),
}

# transformers' in-memory names (a state dict saved as is): text under model.language_model.,
# experts fused as mlp.experts.gate_up_proj [E, 2F, H] (read as "moe.gate_up_proj").
_NATIVE_NAMES = (
    (r"^model\.language_model\.", "model."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".moe.router_bias"),
    (r"\.mlp\.gate\.weight$", ".moe.gate.weight"),
    (r"\.mlp\.experts\.gate_up_proj$", ".moe.gate_up_proj"),
    (r"\.mlp\.experts\.down_proj$", ".moe.down_proj.weight"),
    (r"\.mlp\.shared_experts\.", ".share_expert."),
)


def canonical_name(name: str) -> str:
    """A text tensor's name in StepFun's layout, whichever layout the checkpoint uses."""
    for pattern, replacement in _NATIVE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


_NATIVE = "model.language_model.layers.{}."
WEIGHT_MAP = {
    **with_prefixes(_HUB_WEIGHT_MAP, {"model.": ("model.language_model.",)}),
    **moe.stacked_expert_weight_map(_NATIVE + "mlp."),
    **moe.shared_expert_weight_map(_NATIVE + "mlp."),
    **step3p7_vision.WEIGHT_MAP,
}

STACKED = {"layers.{}.w_experts_gate_up": ("layers.{}.moe_gate", "layers.{}.moe_up")}

# q, k, v and the head gate in one matmul; dense layers and sparse layers fuse their own groups.
FUSED = {
    "layers.{}.wqkvg": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv", "layers.{}.wg"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
    **moe.SHARED_EXPERT_FUSED,
}

_VISION_PREFIXES = ("vision_model.", "vit_large_projector.", "model.vision_model.", "model.multi_modal_projector.")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One layer type's rotary embedding: the first `dim` dims of a head rotate (rotate-half)."""

    theta: float
    dim: int  # rotary dims: int(head_dim * partial_rotary_factor), even
    llama3: bool = False  # llama3 frequency scaling (rope_scaling on full layers)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class Step3p7Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_scale: float  # query_pre_attn_scalar ** -0.5
    layer_heads: tuple[int, ...]  # query heads per layer (sliding layers may have more)
    layer_windows: tuple[int, ...]  # sliding window in tokens, 0 = full attention
    rope_full: RopeSpec
    rope_sliding: RopeSpec
    layer_sparse: tuple[bool, ...]  # MoE (True) or dense MLP
    intermediate_size: int  # dense layers' width
    moe_intermediate_size: int  # each routed expert's width
    share_expert_dim: int  # the shared expert's width
    router: moe.RouterSpec
    routed_limits: tuple[float, ...]  # swiglu_limits per layer, 0 = no clamp
    shared_limits: tuple[float, ...]  # swiglu_limits_shared per layer (shared expert and dense MLP)
    num_mtp_layers: int  # multi-token-prediction layers the checkpoint appends (not compiled)
    vision: step3p7_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: Step 3.7 nests it under text_config, Step-3.5-Flash is flat."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


# Hub-config fields transformers does not read; it always computes what these values say.
_FIXED_BY_TRANSFORMERS = {
    "use_head_wise_attn_gate": True,
    "use_qk_norm": True,
    "zero_centered": True,
    "norm_expert_weight": True,
    "use_moe_router_bias": True,
    "moe_router_activation": "sigmoid",
}


def _check_supported(top: dict[str, Any], hf: dict[str, Any]) -> None:
    def refuse(why: str) -> None:
        raise ValueError(f"{why} is not supported by the {NAME} family")

    if top.get("quantization_config") or hf.get("quantization_config"):
        refuse("quantization_config (quantized checkpoints)")
    if hf.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention (prompt tokens attending forwards)")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            refuse(f"{name} = true")
    gating = hf.get("gating", True)
    if gating is not True and gating != "per-head":
        refuse(f"gating {gating!r} (only the per-head attention gate)")
    for name, value in _FIXED_BY_TRANSFORMERS.items():
        if name in hf and hf[name] != value:
            refuse(f"{name} = {hf[name]!r} (transformers always computes {value!r})")
    if hf.get("use_rope_layers") and not all(hf["use_rope_layers"]):
        refuse("use_rope_layers with layers without rotary")
    if "text_config" in top and hf.get("tie_word_embeddings") and not top.get("tie_word_embeddings"):
        refuse(
            "text_config.tie_word_embeddings without the top-level tie_word_embeddings "
            "(transformers ties Step3p7ForConditionalGeneration's head only on the top-level flag)"
        )


def _per_layer(hf: dict[str, Any], name: str, n: int, padded: int, default: Any) -> list[Any]:
    """A per-layer list, legacy MTP padding (num_nextn_predict_layers extra entries) cut off."""
    value = hf.get(name)
    if value is None:
        return [default] * n
    value = list(value)
    if len(value) == padded:
        value = value[:n]
    if len(value) != n:
        raise ValueError(f"{name} must have {n} entries (num_hidden_layers), got {len(value)}")
    return value


def _mlp_types(hf: dict[str, Any], n: int, padded: int) -> tuple[bool, ...]:
    if hf.get("mlp_layer_types") is not None:
        types = _per_layer(hf, "mlp_layer_types", n, padded, "sparse")
        if set(types) - {"sparse", "dense"}:
            raise ValueError(f"mlp_layer_types must be 'sparse' or 'dense', got {sorted(set(types))}")
        return tuple(t == "sparse" for t in types)
    enum = hf.get("moe_layers_enum")
    if enum is None:
        sparse = set(range(3, n))  # transformers' default: the first three layers dense
    else:
        items = enum.split(",") if isinstance(enum, str) else enum
        sparse = {int(i) for i in items if str(i).strip()}
    return tuple(i in sparse for i in range(n))


def _rope_specs(hf: dict[str, Any], types: list[str], n: int, padded: int, head_dim: int) -> dict[str, RopeSpec]:
    """One RopeSpec per layer type, from transformers' `rope_parameters` per type or the hub's
    per-layer `rope_theta` / `partial_rotary_factors` lists plus `rope_scaling` (full layers)."""
    present = set(types)
    params = hf.get("rope_parameters") or {}
    if not all(isinstance(params.get(t), dict) for t in present):  # the hub layout, as transformers reads it
        theta = hf.get("rope_theta", 10000.0)
        thetas = _per_layer(hf, "rope_theta", n, padded, 0.0) if isinstance(theta, list) else [theta] * n
        factors = _per_layer(hf, "partial_rotary_factors", n, padded, 1.0)
        params = {}
        for t in present:
            at = [i for i in range(n) if types[i] == t]
            if len({thetas[i] for i in at}) > 1 or len({factors[i] for i in at}) > 1:
                raise ValueError(f"{t} layers with different rope_theta or partial_rotary_factors are not supported")
            params[t] = {"rope_type": "default", "rope_theta": thetas[at[0]], "partial_rotary_factor": factors[at[0]]}
        scaling = hf.get("rope_scaling")
        if scaling:
            if "rope_type" not in scaling:
                raise ValueError(
                    f"rope_scaling without rope_type ({scaling!r}) is not supported (transformers ignores it)"
                )
            only = hf.get("yarn_only_types")
            if SLIDING in present and list(only or []) != [FULL]:
                raise ValueError(
                    f"rope_scaling on layer types {only!r} is not supported (transformers scales "
                    f"full_attention layers only)"
                )
            if FULL in params:
                params[FULL] = params[FULL] | dict(scaling)
    specs = {}
    for t in (FULL, SLIDING):
        p = params.get(t) or {"rope_type": "default", "rope_theta": 10000.0}
        kind = p.get("rope_type") or "default"
        dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
        if dim % 2 or not 0 < dim <= head_dim:
            raise ValueError(
                f"partial_rotary_factor {p.get('partial_rotary_factor')} gives {dim} rotary dims of "
                f"{head_dim}; an even count is needed"
            )
        theta = float(p.get("rope_theta") or 10000.0)
        if kind == "default":
            specs[t] = RopeSpec(theta, dim)
        elif kind == "llama3":
            original = int(p.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 128000))
            specs[t] = RopeSpec(
                theta,
                dim,
                True,
                float(p["factor"]),
                float(p["low_freq_factor"]),
                float(p["high_freq_factor"]),
                original,
            )
        else:
            raise ValueError(
                f"rope type {kind!r} on {t} layers is not supported by the {NAME} family (default and llama3 are)"
            )
    return specs


def _layer_heads(hf: dict[str, Any], types: list[str], n: int) -> tuple[int, ...]:
    heads = int(hf.get("num_attention_heads", 64))
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:  # transformers' saved form
        per_layer = {int(k): v for k, v in per_layer.items()}
        if {k for v in per_layer.values() for k in v} - {"num_attention_heads"}:
            raise ValueError(
                f"per_layer_config overrides other than num_attention_heads are not supported by the {NAME} family"
            )
        return tuple(int(per_layer.get(i, {}).get("num_attention_heads", heads)) for i in range(n))
    sliding = hf.get("num_sliding_attention_heads")
    other = hf.get("attention_other_setting") or {}
    if sliding is None:
        sliding = other.get("num_attention_heads", heads)
    return tuple(int(sliding) if t == SLIDING else heads for t in types)


# The fields read as they stand in the text config (with Step3p7TextConfig's defaults).
_FIELDS = Fields(
    Step3p7Config,
    vocab_size=128815,
    hidden_size=4096,
    rms_norm_eps=1e-5,
    max_position_embeddings=128000,
    intermediate_size=11264,
    moe_intermediate_size=1280,
)


def config_from_hf(hf: dict[str, Any]) -> Step3p7Config:
    """Read a Hugging Face config.json dict (Step 3.7's nested text_config, or a flat step3p5
    config), in StepFun's spellings or transformers'; unsupported variants raise ValueError."""
    top, hf = hf, text_config(hf)
    _check_supported(top, hf)
    n = int(hf.get("num_hidden_layers", 45))
    mtp = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)
    padded = n + mtp
    types = _per_layer(hf, "layer_types", n, padded, FULL)
    if set(types) - {FULL, SLIDING}:
        raise ValueError(
            f"layer types {sorted(set(types) - {FULL, SLIDING})} are not supported by the {NAME} "
            f"family ({FULL} and {SLIDING} are)"
        )
    window = hf.get("sliding_window")
    if SLIDING in types and not window:
        raise ValueError("sliding_attention layers need a sliding_window")
    head_dim = int(hf.get("head_dim", 128))
    kv_heads = int(hf.get("num_attention_groups") or hf.get("num_key_value_heads") or 8)
    other = hf.get("attention_other_setting") or {}
    for key, value in (("num_attention_groups", kv_heads), ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if key in other and int(other[key]) != value:
            raise ValueError(
                f"attention_other_setting.{key} {other[key]} differs from the full layers' {value}; "
                "transformers keeps one kv-head count and head size for every layer"
            )
    heads = _layer_heads(hf, types, n)
    if any(h % kv_heads for h in heads):
        raise ValueError(f"query heads {sorted(set(heads))} must be multiples of the {kv_heads} kv heads")
    ropes = _rope_specs(hf, types, n, padded, head_dim)
    sparse = _mlp_types(hf, n, padded)
    limits = []
    for name in ("swiglu_limits", "swiglu_limits_shared"):
        values = [float(v or 0.0) for v in _per_layer(hf, name, n, padded, 0.0)]
        if any(v < 0 for v in values):
            raise ValueError(f"{name} must be >= 0 (0 = no clamp), got {values}")
        limits.append(tuple(values))
    experts = int(hf.get("moe_num_experts") or hf.get("n_routed_experts") or 288)
    router = moe.RouterSpec(
        num_experts=experts,
        top_k=int(hf.get("moe_top_k") or hf.get("num_experts_per_tok") or 8),
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=float(hf.get("moe_router_scaling_factor", 1.0)),
        has_correction_bias=True,
    )
    share = int(hf.get("share_expert_dims") or hf.get("share_expert_dim") or 1280)
    if share <= 0:
        raise ValueError(f"share_expert_dim must be positive, got {share}")
    return Step3p7Config(
        **_FIELDS.read(hf),
        num_layers=n,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=bool((top if "text_config" in top else hf).get("tie_word_embeddings", False)),
        attention_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        layer_heads=heads,
        layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types),
        rope_full=ropes[FULL],
        rope_sliding=ropes[SLIDING],
        layer_sparse=sparse,
        share_expert_dim=share,
        router=router,
        routed_limits=limits[0],
        shared_limits=limits[1],
        num_mtp_layers=mtp,
        vision=step3p7_vision.config_from_hf(top, hf) if _multimodal(top) else None,
    )


def _multimodal(top: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config beside the nested text_config and an image_token_id
    inside the text vocabulary (transformers embeds the prompt's image tokens before replacing
    them, so no working multimodal checkpoint has one outside). Text-only test checkpoints carry a
    vision_config only so that transformers builds a tiny tower it leaves unused, and no id (or,
    saved by transformers, its default 151679, past their vocabulary)."""
    if not isinstance(top.get("vision_config"), dict) or not isinstance(top.get("text_config"), dict):
        return False
    image = top.get("image_token_id")
    return isinstance(image, int) and 0 <= image < int(top["text_config"].get("vocab_size", 128815))


def ignored_tensor(config: Step3p7Config, name: str) -> bool:
    """Checkpoint tensors export leaves out: the vision tower and projector of a text-only config,
    and the MTP layers (layer numbers num_layers .. num_layers + num_mtp_layers - 1)."""
    if name.startswith(_VISION_PREFIXES):
        return config.vision is None
    match = _LAYER.match(name)
    return match is not None and config.num_layers <= int(match.group(1)) < config.num_layers + config.num_mtp_layers


def canonical_tensors(config: Step3p7Config, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A multimodal checkpoint's vision tensors in transformers' names, whichever layout it ships
    (StepFun's vision_model.transformer.resblocks.* or transformers' model.vision_model.*)."""
    return tensors if config.vision is None else step3p7_vision.native_tensors(config.vision, tensors)


def kv_shape(config: Step3p7Config) -> tuple[int, int, int]:
    return config.num_layers, config.num_kv_heads, config.head_dim


def window_pool(config: Step3p7Config) -> tuple[int, tuple[int, ...]] | None:
    """The sliding layers' keys and values in a second page pool (KvLayout.window_pool), freed behind
    the window by helios. None without sliding layers."""
    windows = config.layer_windows
    if not any(windows):
        return None
    return max(windows), tuple(index for i, w in enumerate(windows) if w > 0 for index in (2 * i, 2 * i + 1))


def decode_weight_bytes(config: Step3p7Config, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per sparse layer."""
    text = {k: v for k, v in weights.items() if not k.startswith("vision.")}  # the tower runs per image, not per step
    return moe.decode_weight_bytes(config, text, config.router.top_k)
