"""The step5 family: StepFun's Step 3.5/3.7 text architecture (transformers' Step3p7 text model).

What it computes, as transformers 5.24's modeling_step3p7 does (checked against its
Step3p7ForConditionalGeneration on the text path):
- Gemma-style RMSNorm `x * (1 + w)` (input, post-attention, final, and per-head q/k norms);
  embeddings unscaled; scores scaled by query_pre_attn_scalar**-0.5 (default head_dim).
- `layer_types`: "sliding_attention" layers see keys p - window < j <= p (the window passed to
  flare::paged_attention), "full_attention" layers are plainly causal. Text tokens get only
  these two causal masks: `use_bidirectional_attention` (off in the released configs) would
  make the prompt attend forwards, which an incremental KV cache cannot compute, so it is refused.
- Sliding layers have their own query-head count (`attention_other_setting` /
  num_sliding_attention_heads / per_layer_config); kv heads and head size are shared, so the
  paged cache is one uniform layout.
- Rotary per layer type: its own base and partial_rotary_factor (rotate-half over the first
  `rotary_dim` dims of a head, the rest passes through), and `rope_scaling` (llama3) on full
  layers only.
- A per-head sigmoid gate (`g_proj`, one scalar per head) multiplies the attention output
  before o_proj.
- MLPs: dense SwiGLU layers and sparse layers (`mlp_layer_types` / `moe_layers_enum`): sigmoid
  router, selection bias (`router_bias`), top-k renormalized weights scaled by
  moe_router_scaling_factor, plus an always-on shared expert. Gates and ups are clamped per
  layer (`silu_clamp_after`: min(silu(gate), L) * clamp(up, -L, L)): routed experts by
  `swiglu_limits`, the shared expert AND the dense MLP by `swiglu_limits_shared` (0 = none).
Tensors export leaves out: the multi-token-prediction layers past num_hidden_layers
(transformers ignores those too), and the vision tower and projector of a checkpoint that is
not multimodal. Multimodal checkpoints (a vision_config and a top-level image_token_id inside
the vocabulary, see _multimodal) export a vision program (step3p7_vision.py); the step
then takes image_features / image_rows and those rows' input embeddings are the features.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import moe, step3p7_vision
from ignition.models.common import DecoderProgram, rotate_half
from ignition.models.gemma3 import FULL, SLIDING, gemma_norm
from ignition.models.heads import step_outputs

FAMILY = "step5"
HF_ARCHITECTURES = ("Step3p7ForConditionalGeneration",)
HF_MODEL_TYPES = ("step3p7", "step3p5")  # the multimodal wrapper and its text model (Step-3.5-Flash's own type)
GGUF_ARCHITECTURES: tuple[str, ...] = ()

# Exports default to float32 until the 16-bit program is checked on a real checkpoint.
ACCURATE_16BIT = False

_L = "model.layers.{}."
# Checkpoint names (StepFun's layout, which transformers' save_pretrained also writes) -> internal.
_HUB_WEIGHT_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    _L + "input_layernorm.weight": "layers.{}.attn_norm",
    _L + "post_attention_layernorm.weight": "layers.{}.mlp_norm",
    _L + "self_attn.q_proj.weight": "layers.{}.wq",
    _L + "self_attn.k_proj.weight": "layers.{}.wk",
    _L + "self_attn.v_proj.weight": "layers.{}.wv",
    _L + "self_attn.g_proj.weight": "layers.{}.wg",
    _L + "self_attn.o_proj.weight": "layers.{}.wo",
    _L + "self_attn.q_norm.weight": "layers.{}.q_norm",
    _L + "self_attn.k_norm.weight": "layers.{}.k_norm",
    _L + "mlp.gate_proj.weight": "layers.{}.w_gate",  # dense layers
    _L + "mlp.up_proj.weight": "layers.{}.w_up",
    _L + "mlp.down_proj.weight": "layers.{}.w_down",
    _L + "moe.gate.weight": "layers.{}.w_router",
    _L + "moe.router_bias": "layers.{}.router_bias",
    _L + "moe.gate_proj.weight": "layers.{}.moe_gate",  # [E, F, H], stacked into w_experts_gate_up
    _L + "moe.up_proj.weight": "layers.{}.moe_up",
    _L + "moe.down_proj.weight": "layers.{}.w_experts_down",  # [E, H, F]
    _L + "share_expert.gate_proj.weight": "layers.{}.shared.w_gate",
    _L + "share_expert.up_proj.weight": "layers.{}.shared.w_up",
    _L + "share_expert.down_proj.weight": "layers.{}.w_shared_down",
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


WEIGHT_MAP = {
    **_HUB_WEIGHT_MAP,
    **{
        "model.language_model." + k.removeprefix("model."): v
        for k, v in _HUB_WEIGHT_MAP.items()
        if k.startswith("model.")
    },
    "model.language_model.layers.{}.mlp.gate.weight": "layers.{}.w_router",
    "model.language_model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.router_bias",
    "model.language_model.layers.{}.mlp.experts.gate_up_proj": "layers.{}.w_experts_gate_up",
    "model.language_model.layers.{}.mlp.experts.down_proj": "layers.{}.w_experts_down",
    "model.language_model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.shared.w_gate",
    "model.language_model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.shared.w_up",
    "model.language_model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.w_shared_down",
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
        raise ValueError(f"{why} is not supported by the {FAMILY} family")

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
                f"rope type {kind!r} on {t} layers is not supported by the {FAMILY} family (default and llama3 are)"
            )
    return specs


def _layer_heads(hf: dict[str, Any], types: list[str], n: int) -> tuple[int, ...]:
    heads = int(hf.get("num_attention_heads", 64))
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:  # transformers' saved form
        per_layer = {int(k): v for k, v in per_layer.items()}
        if {k for v in per_layer.values() for k in v} - {"num_attention_heads"}:
            raise ValueError(
                f"per_layer_config overrides other than num_attention_heads are not supported by the {FAMILY} family"
            )
        return tuple(int(per_layer.get(i, {}).get("num_attention_heads", heads)) for i in range(n))
    sliding = hf.get("num_sliding_attention_heads")
    other = hf.get("attention_other_setting") or {}
    if sliding is None:
        sliding = other.get("num_attention_heads", heads)
    return tuple(int(sliding) if t == SLIDING else heads for t in types)


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
            f"layer types {sorted(set(types) - {FULL, SLIDING})} are not supported by the {FAMILY} "
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
        vocab_size=int(hf.get("vocab_size", 128815)),
        hidden_size=int(hf.get("hidden_size", 4096)),
        num_layers=n,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 128000)),
        tie_word_embeddings=bool((top if "text_config" in top else hf).get("tie_word_embeddings", False)),
        attention_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        layer_heads=heads,
        layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types),
        rope_full=ropes[FULL],
        rope_sliding=ropes[SLIDING],
        layer_sparse=sparse,
        intermediate_size=int(hf.get("intermediate_size", 11264)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 1280)),
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


# ---------------------------------------------------------------------------- step program


def inv_freq(spec: RopeSpec, device: Any = None) -> Tensor:
    """[dim / 2] fp32 inverse frequencies, llama3-scaled where the spec says (transformers' formula)."""
    exps = torch.arange(0, spec.dim, 2, dtype=torch.int64, device=device).float() / spec.dim
    inv = 1.0 / (spec.theta**exps)
    if not spec.llama3:
        return inv
    old = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _cos_sin(positions: Tensor, spec: RopeSpec) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq(spec, positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, dim]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]: rotate-half over the first cos.shape[-1] dims, the rest unchanged."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def _activation(limit: float) -> moe.ExpertActivation:
    return moe.ExpertActivation("silu_clamp_after", limit)


class StepProgram(DecoderProgram):
    """Step 3.7's step over the flare:: paged-KV ops (see the module docstring)."""

    def attention(
        self,
        weights: dict[str, Tensor],
        i: int,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        kv_cache: list[Tensor],
        paged: tuple[Tensor, ...],
    ) -> Tensor:
        """h [T, hidden] in the core dtype -> the gated attention block's output [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        slot_mapping, block_tables, seq_lens, query_start_loc, positions = paged
        heads, kvh, hd, eps = c.layer_heads[i], c.num_kv_heads, c.head_dim, c.rms_norm_eps
        q, k, v, gate = F.linear(h, weights[p + "wqkvg"]).float().split([heads * hd, c.kv_dim, c.kv_dim, heads], dim=-1)
        cos, sin = rope
        q = apply_rope(gemma_norm(q.reshape(-1, heads, hd), weights[p + "q_norm"], eps), cos, sin)
        k = apply_rope(gemma_norm(k.reshape(-1, kvh, hd), weights[p + "k_norm"], eps), cos, sin)
        v = v.reshape(-1, kvh, hd)
        k_cache, v_cache = kv_cache[2 * i], kv_cache[2 * i + 1]
        kvt = k_cache.dtype
        torch.ops.flare.write_kv(k_cache, v_cache, k.to(kvt), v.to(kvt), slot_mapping)
        attn = torch.ops.flare.paged_attention(
            q.to(kvt),
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            positions,
            c.attention_scale,
            c.layer_windows[i],
            0.0,
        )
        attn = attn.float() * torch.sigmoid(gate)[:, :, None]  # one gate per head
        return F.linear(attn.reshape(-1, heads * hd).to(h.dtype), weights[p + "wo"]).float()

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        c, p = self.config, f"layers.{layer}."
        shared = _activation(c.shared_limits[layer])
        if not c.layer_sparse[layer]:  # the dense MLP clamps with the shared expert's limit, as transformers does
            return moe.shared_mlp(h, weights[p + "w_gate_up"], weights[p + "w_down"], shared)
        return moe.sparse_moe(
            c.router, weights, layer, h, _activation(c.routed_limits[layer]), shared=True, shared_activation=shared
        )

    def forward(
        self,
        weights,
        kv_cache,
        token_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        extra_1=None,
        extra_2=None,
        extra_3=None,
        extra_4=None,
        extra_5=None,
        extra_6=None,
    ):
        """Vision cores take image_features [I, hidden] and image_rows [I] last (program_signature):
        those rows' input embeddings are the features (transformers' masked_scatter); rows of -1 are
        unused. Sliding layers' caches are in the window pool: window_slot_mapping / window_block_tables."""
        extra = [t for t in (extra_1, extra_2, extra_3, extra_4, extra_5, extra_6) if t is not None]
        image = (extra.pop(-2), extra.pop(-1)) if self.config.vision is not None else None
        pooled = (extra.pop(0), extra.pop(0)) if window_pool(self.config) is not None else (slot_mapping, block_tables)
        logprob_ids, target_ids = self.optional_inputs(*(extra + [None, None])[:2])
        c = self.config
        eps = c.rms_norm_eps
        # As in the other families: weights and matmul inputs in the core's dtype, residual
        # stream, norms, rotary, gate and router in fp32.
        wdt = weights["embed"].dtype
        x = F.embedding(token_ids, weights["embed"]).float()
        if image is not None:
            features, rows = image
            T = x.shape[0]
            rows = torch.where(rows < 0, T, rows)  # unused rows land on a scratch row past the end
            x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_copy(0, rows, features.float())[:T]
        ropes = {
            window > 0: _cos_sin(positions, c.rope_sliding if window else c.rope_full)
            for window in set(c.layer_windows)
        }
        paged = (slot_mapping, block_tables, seq_lens, query_start_loc, positions)
        windowed = (*pooled, seq_lens, query_start_loc, positions)  # sliding layers: the window pool's slots, tables
        for i, window in enumerate(c.layer_windows):
            h = gemma_norm(x, weights[f"layers.{i}.attn_norm"], eps).to(wdt)
            x = x + self.attention(weights, i, h, ropes[window > 0], kv_cache, windowed if window > 0 else paged)
            h = gemma_norm(x, weights[f"layers.{i}.mlp_norm"], eps).to(wdt)
            x = x + self.mlp(weights, i, h).float()
        x = gemma_norm(x, weights["norm"], eps).to(wdt)
        return step_outputs(x, weights, c.tie_word_embeddings, logits_indices, self.num_top, logprob_ids, target_ids)


# ---------------------------------------------------------------------- plain reference


def _reference_inv_freq(spec: RopeSpec) -> list[float]:
    """Inverse frequencies in plain Python floats (llama3's blend spelled out per frequency)."""
    out = []
    for j in range(0, spec.dim, 2):
        f = spec.theta ** (-j / spec.dim)
        if spec.llama3:
            old = spec.original_max_position_embeddings
            wavelen = 2 * math.pi / f
            if wavelen > old / spec.low_freq_factor:
                f = f / spec.factor
            elif wavelen >= old / spec.high_freq_factor:  # between the bounds: interpolate
                s = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
                f = (1 - s) * f / spec.factor + s * f
        out.append(f)
    return out


def reference_logits(
    config: Step3p7Config,
    hf_weights: dict[str, Tensor],
    token_ids: list[int],
    image_features: Tensor | None = None,
    image_positions: list[int] | None = None,
) -> Tensor:
    """Dense, unpaged forward over checkpoint-named weights in float64: logits [T, V] fp32.

    Independent of the program: unfused weights, explicit per-layer masks, rotary as complex
    rotations, routing by sorting and a loop over experts. Images: row i of image_features
    replaces the input embedding at image_positions[i].
    """
    c = config
    f64 = torch.float64
    w = {canonical_name(k): v for k, v in hf_weights.items() if not ignored_tensor(c, k)}
    W = lambda name: w[name].to(f64)  # noqa: E731
    T = len(token_ids)
    pos = torch.arange(T, dtype=f64)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)].to(f64)
    if image_positions:
        assert image_features is not None
        x[torch.tensor(image_positions)] = image_features.to(f64)

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1.0 + weight)

    def rotate(t: Tensor, spec: RopeSpec) -> Tensor:  # t [heads, T, D]
        angles = pos[:, None] * torch.tensor(_reference_inv_freq(spec), dtype=f64)[None, :]
        half = spec.dim // 2
        z = torch.complex(t[..., :half], t[..., half : spec.dim]) * torch.polar(torch.ones_like(angles), angles)
        return torch.cat([z.real, z.imag, t[..., spec.dim :]], dim=-1)

    def act(gate: Tensor, up: Tensor, limit: float) -> Tensor:
        silu = gate / (1.0 + torch.exp(-gate))
        if limit > 0:
            silu, up = torch.minimum(silu, torch.tensor(limit, dtype=f64)), up.clamp(-limit, limit)
        return silu * up

    i_, j_ = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        heads, hd, window = c.layer_heads[i], c.head_dim, c.layer_windows[i]
        spec = c.rope_sliding if window else c.rope_full
        h = norm(x, W(p + "input_layernorm.weight"))
        q = norm((h @ W(a + "q_proj.weight").T).view(T, heads, hd), W(a + "q_norm.weight")).transpose(0, 1)
        k = norm((h @ W(a + "k_proj.weight").T).view(T, -1, hd), W(a + "k_norm.weight")).transpose(0, 1)
        v = (h @ W(a + "v_proj.weight").T).view(T, -1, hd).transpose(0, 1)
        q, k = rotate(q, spec), rotate(k, spec)
        group = heads // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        visible = (j_ <= i_) & ((j_ > i_ - window) if window else True)
        scores = (q @ k.transpose(1, 2)) * c.attention_scale
        attn = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [H, T, D]
        gate = 1.0 / (1.0 + torch.exp(-(h @ W(a + "g_proj.weight").T)))  # [T, H]
        attn = (attn.transpose(0, 1) * gate[:, :, None]).reshape(T, heads * hd)
        x = x + attn @ W(a + "o_proj.weight").T
        h = norm(x, W(p + "post_attention_layernorm.weight"))
        shared_limit = c.shared_limits[i]
        if not c.layer_sparse[i]:
            mlp = act(h @ W(p + "mlp.gate_proj.weight").T, h @ W(p + "mlp.up_proj.weight").T, shared_limit)
            x = x + mlp @ W(p + "mlp.down_proj.weight").T
            continue
        x = x + _reference_moe(c, W, set(w), p, h, lambda g, u: act(g, u, c.routed_limits[i]))  # noqa: B023 - called at once
        s = p + "share_expert."
        x = (
            x
            + act(h @ W(s + "gate_proj.weight").T, h @ W(s + "up_proj.weight").T, shared_limit)
            @ W(s + "down_proj.weight").T
        )
    x = norm(x, W("model.norm.weight"))
    head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"].to(f64)
    return (x @ head.T).float()


def _reference_moe(c: Step3p7Config, W, names: set[str], p: str, h: Tensor, act) -> Tensor:
    """The routed experts of one sparse layer (either expert layout), h [T, H] float64;
    act(gate, up) is the layer's clamped activation."""
    r = c.router
    scores = 1.0 / (1.0 + torch.exp(-(h @ W(p + "moe.gate.weight").T)))  # [T, E]
    ids = (scores + W(p + "moe.router_bias")).argsort(-1, descending=True)[:, : r.top_k]
    top = scores.gather(1, ids)
    top = top / top.sum(-1, keepdim=True) * r.routed_scaling_factor
    if p + "moe.gate_up_proj" in names:
        gate_w, up_w = W(p + "moe.gate_up_proj").chunk(2, dim=1)
    else:
        gate_w, up_w = W(p + "moe.gate_proj.weight"), W(p + "moe.up_proj.weight")
    down_w = W(p + "moe.down_proj.weight")
    out = torch.zeros_like(h)
    for e in range(r.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = act(h[rows] @ gate_w[e].T, h[rows] @ up_w[e].T) @ down_w[e].T
            out.index_add_(0, rows, y * top[rows, slots, None])
    return out


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Step-3.5-Flash's published template and tokens (testmodel.CHATS "step").
TEST_CHAT: str | None = "step"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Step 3.7 config in StepFun's own spellings (nested text_config, legacy per-layer
    lists padded with one MTP layer): full/sliding/sliding/full layers, window 8 (< a 16-token
    page), 4 query heads on full layers and 6 on sliding ones over 2 kv heads, partial rotary
    with llama3 scaling on full layers, one dense layer then three MoE layers of 8 experts
    (top 2, selection bias, scaling 2.5, a shared expert), clamps on some layers that bite."""
    text = {
        "model_type": "step3p5",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "share_expert_dim": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 16,
        "attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 2, "head_dim": 16},
        "layer_types": [FULL, SLIDING, SLIDING, FULL, FULL],
        "sliding_window": 8,
        "rope_theta": [5_000_000.0, 10_000.0, 10_000.0, 5_000_000.0, 5_000_000.0],
        "partial_rotary_factors": [0.5, 1.0, 1.0, 0.5, 0.5],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0,
            "high_freq_factor": 32.0,
        },
        "yarn_only_types": [FULL],
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "moe_router_scaling_factor": 2.5,
        "moe_layers_enum": "1,2,3,4",
        "swiglu_limits": [0.0, 0.0, 1.5, 0.0, 0.0],
        "swiglu_limits_shared": [1.5, 0.0, 0.0, 2.0, 0.0],
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    vision = {"width": 16, "layers": 1, "heads": 2, "image_size": 28, "patch_size": 14, "max_position_embeddings": 4}
    return {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "text_config": text,
        "vision_config": vision,
        "max_position_embeddings": 4096,  # also at the top, where testmodel reads the tokenizer's length
        "torch_dtype": "float32",
    }


def _layer_shapes(c: Step3p7Config, i: int) -> dict[str, tuple[int, ...]]:
    h, hd, heads, kv = c.hidden_size, c.head_dim, c.layer_heads[min(i, c.num_layers - 1)], c.kv_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, heads * hd),
        "self_attn.g_proj.weight": (heads, h),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }
    if i < c.num_layers and not c.layer_sparse[i]:
        f = c.intermediate_size
        return shapes | {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    e, f, s = c.router.num_experts, c.moe_intermediate_size, c.share_expert_dim
    return shapes | {
        "moe.gate.weight": (e, h),
        "moe.router_bias": (e,),
        "moe.gate_proj.weight": (e, f, h),
        "moe.up_proj.weight": (e, f, h),
        "moe.down_proj.weight": (e, h, f),
        "share_expert.gate_proj.weight": (s, h),
        "share_expert.up_proj.weight": (s, h),
        "share_expert.down_proj.weight": (h, s),
    }


def hf_shapes(c: Step3p7Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (StepFun's layout) and shapes, MTP layers included (a decoder
    layer plus its eh_proj / enorm / hnorm, as Step's checkpoints append them); a multimodal
    config's vision tower and projector in transformers' layout."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers + c.num_mtp_layers):
        layer = _layer_shapes(c, i)
        if i >= c.num_layers:
            layer |= {"eh_proj.weight": (h, 2 * h), "enorm.weight": (h,), "hnorm.weight": (h,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    if c.vision is not None:
        shapes |= step3p7_vision.hf_shapes(c.vision)
    return shapes


# Test vision checkpoints: the "step" chat flavour plus the processor's framing tokens.
TESTMODEL_VISION_TOKENS = ("<im_patch>", *step3p7_vision.FRAMING)


def testmodel_vision(config: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """testmodel_config's checkpoint made multimodal: a 2-layer vision tower of width 32 (4 heads)
    over 14-pixel patches with a 12 x 12 position grid (a 168-pixel global view, 9 tokens; 112-pixel
    tiles, 4 tokens each, whose positions are interpolated), projector with a bias, and the
    tokenizer's <im_patch> as image_token_id. `tokens`: TESTMODEL_VISION_TOKENS -> ids."""
    vision = {
        "width": 32,
        "layers": 2,
        "heads": 4,
        "image_size": 168,
        "patch_size": 14,
        "mlp_ratio": 2.0,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
        "ls_init_value": 0.5,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    return config | {"vision_config": vision, "image_token_id": tokens["<im_patch>"], "projector_bias": True}


# Step3p7ImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json).
TESTMODEL_PROCESSOR = {
    "image_processor_type": "Step3p7ImageProcessor",
    "size": {"height": 168, "width": 168},
    "patch_size": 112,
    "max_image_size": 448,
}


# ------------------------------------------------------------------------- vision hooks (ignition.export)


def vision_program(config: Step3p7Config) -> torch.nn.Module:
    assert config.vision is not None
    return step3p7_vision.VisionProgram(config.vision)


def vision_examples(config: Step3p7Config) -> tuple[Tensor, Tensor]:
    assert config.vision is not None
    return step3p7_vision.example_inputs(config.vision)


def reference_features(
    config: Step3p7Config, hf_weights: dict[str, Tensor], pixels: Tensor, positions: Tensor
) -> Tensor:
    assert config.vision is not None
    return step3p7_vision.reference_features(config.vision, hf_weights, pixels, positions)


def vision_profile(config: Step3p7Config, processor: dict[str, Any], max_model_len: int, token_id=None):
    assert config.vision is not None
    return step3p7_vision.profile(config.vision, processor, max_model_len, token_id or (lambda text: None))
