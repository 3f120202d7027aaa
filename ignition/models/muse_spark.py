"""The Muse Spark text family (MuseSparkForConditionalGeneration's language model): config, weight maps,
step program, reference.

As transformers 5.24's modeling_muse_spark computes the text model:
- Embeddings get a weightless RMSNorm; the final norm is RMSNorm `x * w`.
- Pre-norms (input_layernorm, pre_feedforward_layernorm, the MoE pre_expert_norm) are "centered"
  RMSNorm `norm(x) * (1 + w)`; post_attention_layernorm is weightless (eps post_norm_eps);
  post_feedforward_layernorm and each expert's post_expert_norm are "input-scaled": `norm(x * (1 + w))`.
- Attention: GQA with weightless q/k RMSNorm (q then times qk_scale_factor, scores times
  head_dim**-0.5), rotary on every layer whose layer_rope_theta is non-zero (NoPE where it is 0),
  a sliding window on "sliding_attention" layers, a weightless per-head RMSNorm on the output, then
  an elementwise sigmoid gate (self_attn.gate_proj of the layer input) before o_proj.
- Residual gates instead of plain adds: x = alpha * x + beta * sublayer, beta = sigmoid(g / T),
  alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), 1e-3)), per channel, T = residual_gate_temperature.
- MLPs per layer (mlp_layer_types): a dense SwiGLU, or the MoE block: sigmoid router over
  logits * output_multiplier with a selection-only correction bias, top-k, renormalized (+1e-15)
  and scaled by routed_scaling_factor; the input is projected to moe_hidden_size (pre_expert_proj,
  centered norm), the routed SwiGLU experts run there with a post-expert norm before their routing
  weight, and post_expert_proj projects back. No shared experts, no expert groups.
- Logits: lm_head(x) * output_multiplier, then cap * tanh(logits / cap) (final_logit_softcapping).
- The multimodal wrapper embeds image/video/audio placeholder ids as token 0 when no media is given;
  the program does the same, so any token id matches the wrapper's text-only forward.
Text weights live under `model.language_model.` (and `lm_head.`). Multimodal checkpoints (a
vision_config and an image token id inside the text vocabulary, see _multimodal) export the vision
tower, adapter and projection as the vision program (muse_spark_vision.py); the step then takes
image_features / image_rows and those rows' input embeddings are the features (transformers'
masked_scatter after the embedding norm; image tokens keep plain 1-D positions and the causal mask).
A text-only config (`text_only: true`, as the text test checkpoints carry, whose tiny tower config
only lets transformers build the model) refuses vision tensors by name; the audio tower is not
compiled (its tensors are refused by name at export).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import moe, muse_spark_vision, vision_hooks
from ignition.models.common import DecoderFields, DecoderProgram, offset_norm, rope, rotate_half, swiglu
from ignition.models.family import Family, PromptImages, Reference, TinyCheckpoint, TinyVision
from ignition.models.hf_config import REQUIRED, Fields, Key
from ignition.models.naming import refuse_vision_tensors
from ignition.models.step import StepInputs, cached_attention, embed_images

NAME = "muse_spark"
HF_ARCHITECTURES = ("MuseSparkForConditionalGeneration",)
HF_MODEL_TYPES = ("muse_spark",)

# transformers keeps the router, its bias and the residual gates in fp32 even in a bf16 model; a
# 16-bit core rounds them to its dtype, which is unchecked against a real checkpoint, so exports
# default to float32 (like gemma3/gemma4) until it is.
ACCURATE_16BIT = False

SLIDING, FULL = "sliding_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
RESIDUAL_GATE_EPS = 1e-3  # MuseSparkResidualGate's clamp of alpha**2
TOPK_NORM_EPS = 1e-15  # MuseSparkTopkRouter.norm_topk_prob_eps

# MuseSparkTextConfig's defaults, for keys a config.json leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202_048,
    "hidden_size": 8192,
    "intermediate_size": 16384,
    "num_hidden_layers": 62,
    "num_attention_heads": 128,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "sliding_window": 2048,
    "final_logit_softcapping": 20.0,
    "qk_scale_factor": 5.4730064863875,
    "output_multiplier": 0.1767766952966369,
    "post_norm_eps": 1e-8,
    "hidden_act": "silu",
    "moe_intermediate_size": 4096,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0,
    "moe_hidden_size": 4096,
    "residual_gate_temperature": 0.3,
}
DEFAULT_ROPE_THETA = 500_000.0
# MuseSparkConfig's placeholder ids (embedded as token 0 by the wrapper when no media is given).
PLACEHOLDER_DEFAULTS = {"image_token_id": 200092, "video_token_id": 200091, "audio_token_id": 200038}

_P = "model.language_model."
_L = _P + "layers.{}."
WEIGHT_MAP = {
    _P + "embed_tokens.weight": "embed",
    _P + "norm.weight": "norm",
    "lm_head.weight": "lm_head",
    _L + "input_layernorm.weight": "layers.{}.attn_norm",
    _L + "pre_feedforward_layernorm.weight": "layers.{}.mlp_norm",
    _L + "post_feedforward_layernorm.weight": "layers.{}.post_mlp_norm",
    _L + "post_attention_residual_gate.gate": "layers.{}.attn_residual_gate",
    _L + "post_feedforward_residual_gate.gate": "layers.{}.mlp_residual_gate",
    _L + "self_attn.q_proj.weight": "layers.{}.wq",
    _L + "self_attn.k_proj.weight": "layers.{}.wk",
    _L + "self_attn.v_proj.weight": "layers.{}.wv",
    _L + "self_attn.gate_proj.weight": "layers.{}.w_attn_gate",
    _L + "self_attn.o_proj.weight": "layers.{}.wo",
    _L + "mlp.gate_proj.weight": "layers.{}.w_gate",  # dense layers
    _L + "mlp.up_proj.weight": "layers.{}.w_up",
    _L + "mlp.down_proj.weight": "layers.{}.w_down",
    _L + "mlp.pre_expert_proj.weight": "layers.{}.w_pre_expert",  # MoE layers
    _L + "mlp.pre_expert_norm.weight": "layers.{}.pre_expert_norm",
    _L + "mlp.experts.post_expert_norm.weight": "layers.{}.post_expert_norm",
    _L + "mlp.post_expert_proj.weight": "layers.{}.w_post_expert",
    **moe.expert_weight_map(mlp=_L + "mlp."),
} | muse_spark_vision.WEIGHT_MAP

STACKED = moe.STACKED_EXPERTS

# q, k, v and the output gate all read the normed layer input: one matmul. Dense and MoE layers
# each lack the other's MLP group; export skips a group absent from a layer.
FUSED = {
    "layers.{}.wqkvg": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv", "layers.{}.w_attn_gate"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class MuseSparkConfig(DecoderFields):
    """Muse Spark's text model (rms_norm_eps: the pre-norms, q/k/o norms, embedding and final norm)."""

    intermediate_size: int  # dense layers' SwiGLU width
    post_norm_eps: float  # post-attention, post-feedforward and post-expert norms
    layer_windows: tuple[int, ...]  # per layer: sliding window in tokens, 0 = full attention
    layer_rope: tuple[bool, ...]  # per layer: rotary on (False: NoPE)
    layer_sparse: tuple[bool, ...]  # per layer: MoE block (False: dense SwiGLU)
    qk_scale_factor: float
    output_multiplier: float  # router logits and final logits are multiplied by it
    final_softcap: float  # > 0
    residual_gate_temperature: float
    moe_hidden_size: int  # width the experts run at
    moe_intermediate_size: int  # each expert's SwiGLU width
    router: moe.RouterSpec
    placeholder_ids: tuple[int, ...]  # embedded as token 0
    vision: muse_spark_vision.VisionConfig | None = None  # the vision tower of a multimodal checkpoint


def _text(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") not in (None, *HF_MODEL_TYPES) or not isinstance(hf.get("text_config"), dict):
        raise ValueError(
            f"the {NAME} family reads MuseSparkForConditionalGeneration configs (model_type "
            f"muse_spark, the text model under text_config), not {hf.get('model_type')!r}"
        )
    return {**TEXT_DEFAULTS, **{k: v for k, v in hf["text_config"].items() if v is not None}}


def _rope_theta(t: dict[str, Any]) -> float:
    params = dict(t.get("rope_scaling") or {}) | dict(t.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ValueError(f"rope_parameters rope_type {kind!r} is not supported by the {NAME} family (default is)")
    return float(params.get("rope_theta") or t.get("rope_theta") or DEFAULT_ROPE_THETA)


def _per_layer(
    t: dict[str, Any], num_layers: int, theta: float
) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[bool, ...]]:
    """(windows, rotary on, sparse) per layer, with MuseSparkTextConfig's defaults: every 4th layer
    counted back from the last is full attention and NoPE, the rest sliding with rotary; all MoE."""
    last = num_layers - 1
    types = t.get("layer_types") or [FULL if (last - i) % 4 == 0 else SLIDING for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {num_layers} layers as {SLIDING} or {FULL}, got {types!r}")
    window = int(t.get("sliding_window") or 0)
    if SLIDING in types and window <= 0:
        raise ValueError("sliding_attention layers need a positive sliding_window")
    thetas = t.get("layer_rope_theta")
    if thetas is None:
        thetas = [0 if (last - i) % 4 == 0 else theta for i in range(num_layers)]
    if len(thetas) != num_layers:
        raise ValueError(f"layer_rope_theta must have {num_layers} entries, got {len(thetas)}")
    # transformers rotates every non-zero layer with the global rope_theta, whatever the value says.
    if any(float(v) not in (0.0, theta) for v in thetas):
        raise ValueError(
            f"layer_rope_theta values other than 0 (NoPE) and rope_theta {theta:g} are not supported by "
            f"the {NAME} family (transformers 5.24 ignores them): {thetas!r}"
        )
    mlps = t.get("mlp_layer_types") or [SPARSE] * num_layers
    if len(mlps) != num_layers or set(mlps) - {DENSE, SPARSE}:
        raise ValueError(f"mlp_layer_types must name {num_layers} layers as {DENSE} or {SPARSE}, got {mlps!r}")
    return (
        tuple(window if k == SLIDING else 0 for k in types),
        tuple(float(v) != 0.0 for v in thetas),
        tuple(m == SPARSE for m in mlps),
    )


def _check_supported(hf: dict[str, Any], t: dict[str, Any]) -> None:
    if hf.get("quantization_config") or t.get("quantization_config"):
        raise ValueError(
            f"quantization_config (quantized checkpoints, e.g. NVFP4) is not supported by the {NAME} family yet"
        )
    if t.get("attention_bias"):
        raise ValueError(f"attention_bias is not supported by the {NAME} family")
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported by the {NAME} family (silu is)")
    if hf.get("tie_word_embeddings") or t.get("tie_word_embeddings"):
        raise ValueError(
            f"tie_word_embeddings is not supported by the {NAME} family (the model keeps its own "
            "lm_head; transformers' MuseSparkForConditionalGeneration ties nothing)"
        )
    if float(t["final_logit_softcapping"]) <= 0:
        raise ValueError(f"final_logit_softcapping must be positive for the {NAME} family (the model divides by it)")


# The fields read as they stand in the text config (TEXT_DEFAULTS fill in the absent ones).
_FIELDS = Fields(
    MuseSparkConfig,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    intermediate_size=REQUIRED,
    num_kv_heads=Key("num_key_value_heads"),
    rms_norm_eps=REQUIRED,
    post_norm_eps=REQUIRED,
    max_position_embeddings=REQUIRED,
    qk_scale_factor=REQUIRED,
    final_softcap=Key("final_logit_softcapping"),
    residual_gate_temperature=REQUIRED,
    moe_hidden_size=REQUIRED,
    moe_intermediate_size=REQUIRED,
)


def config_from_hf(hf: dict[str, Any]) -> MuseSparkConfig:
    """Read a MuseSparkForConditionalGeneration config.json dict; unsupported variants raise ValueError."""
    t = _text(hf)
    _check_supported(hf, t)
    num_layers = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    theta = _rope_theta(t)
    windows, rotary, sparse = _per_layer(t, num_layers, theta)
    multiplier = float(t["output_multiplier"])
    router = moe.RouterSpec(
        num_experts=int(t["num_local_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        has_correction_bias=True,
        norm_eps=TOPK_NORM_EPS,
        logit_scale=multiplier,
    )
    return MuseSparkConfig(
        **_FIELDS.read(t),
        num_layers=num_layers,
        num_heads=heads,
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        rope_theta=theta,
        layer_windows=windows,
        layer_rope=rotary,
        layer_sparse=sparse,
        output_multiplier=multiplier,
        tie_word_embeddings=False,  # never: the wrapper keeps its own lm_head
        router=router,
        placeholder_ids=tuple(int(hf.get(k) if hf.get(k) is not None else v) for k, v in PLACEHOLDER_DEFAULTS.items()),
        vision=muse_spark_vision.config_from_hf(hf, t) if _multimodal(hf, t) else None,
    )


def _multimodal(hf: dict[str, Any], t: dict[str, Any]) -> bool:
    """A vision tower to compile: a vision_config, an image token id (else MuseSparkConfig's default)
    inside the text vocabulary, and no `text_only: true` (the text test checkpoints' marker: their
    tiny vision_config is only there so transformers builds a tower they leave out)."""
    if not isinstance(hf.get("vision_config"), dict) or hf.get("text_only"):
        return False
    return 0 <= muse_spark_vision.image_token_id(hf) < int(t["vocab_size"])


def canonical_tensors(config: MuseSparkConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A text-only config refuses vision tensors by name (the audio tower's are unmapped and refused
    by export)."""
    if config.vision is None:
        why = "text_only, no vision_config, or an image token id outside the vocabulary"
        refuse_vision_tensors(tensors, muse_spark_vision.VISION_PREFIXES, why)
    return tensors


def kv_shape(config: MuseSparkConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the paged cache (every layer has one)."""
    return config.num_layers, config.num_kv_heads, config.head_dim


def decode_weight_bytes(config: MuseSparkConfig, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per MoE layer (the vision
    tower runs per image, not per step)."""
    text = {k: v for k, v in weights.items() if not k.startswith("vision.")}
    return moe.decode_weight_bytes(config, text, config.router.top_k)


# ---------------------------------------------------------------------------- step program


def plain_norm(x: Tensor, eps: float) -> Tensor:
    """Weightless RMSNorm in fp32 (embedding, q/k, attention output, post-attention norms)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def input_scaled_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """MuseSparkTextInputScaledRMSNorm: norm(x * (1 + w))."""
    return plain_norm(x.float() * (1.0 + weight.float()), eps)


def residual_gated(residual: Tensor, update: Tensor, gate: Tensor, temperature: float) -> Tensor:
    """MuseSparkResidualGate in fp32: alpha * residual + beta * update, per channel."""
    w = gate.float() / temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=RESIDUAL_GATE_EPS))
    return alpha * residual + beta * update


def text_token_ids(token_ids: Tensor, placeholder_ids: tuple[int, ...]) -> Tensor:
    """Placeholder ids (image/video/audio) become 0, as the multimodal wrapper embeds them without media."""
    out = token_ids
    for placeholder in placeholder_ids:
        out = torch.where(out == placeholder, torch.zeros_like(out), out)
    return out


class StepProgram(DecoderProgram):
    """Muse Spark's step over the flare:: paged-KV ops; sliding layers pass their window to the op."""

    multimodal = True

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        """h [T, hidden] in the core dtype -> [T, hidden] fp32, dense SwiGLU or the MoE block."""
        c, p = self.config, f"layers.{layer}."
        if not c.layer_sparse[layer]:
            return swiglu(weights, p, h).float()
        # The router reads the hidden-size input in fp32 (a 16-bit router flips near-tied choices).
        logits = F.linear(h.float(), weights[p + "w_router"].float())
        top, ids = moe.route(c.router, logits, weights[p + "router_bias"])
        z = offset_norm(F.linear(h, weights[p + "w_pre_expert"]), weights[p + "pre_expert_norm"], c.rms_norm_eps)
        y = moe.routed_mlp(
            z.to(h.dtype),
            top,
            ids,
            weights[p + "w_experts_gate_up"],
            weights[p + "w_experts_down"],
            moe.SWIGLU,
            1.0 + weights[p + "post_expert_norm"].float(),
            c.post_norm_eps,
        )
        return F.linear(y.to(h.dtype), weights[p + "w_post_expert"]).float()

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' (normed) input embeddings are the features."""
        c = self.config
        eps = c.rms_norm_eps
        # As in the other families: weights and matmul inputs in the core dtype; residual stream,
        # norms, gates and rotary in fp32.
        wdt = weights["embed"].dtype
        x = plain_norm(F.embedding(text_token_ids(s.token_ids, c.placeholder_ids), weights["embed"]), eps)
        x = embed_images(x, s)
        cos, sin = rope(s.positions, c.head_dim, c.rope_theta, torch.float32)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.kv_dim
        scale = c.head_dim**-0.5
        for i, window in enumerate(c.layer_windows):
            p = f"layers.{i}."
            h = offset_norm(x, weights[p + "attn_norm"], eps).to(wdt)
            q, k, v, g = F.linear(h, weights[p + "wqkvg"]).float().split([q_dim, kv_dim, kv_dim, q_dim], dim=-1)
            q = plain_norm(q.reshape(-1, c.num_heads, c.head_dim), eps) * c.qk_scale_factor
            k = plain_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), eps)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            if c.layer_rope[i]:
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            attn = cached_attention(q, k, v, kv_cache[2 * i], kv_cache[2 * i + 1], s.paged, scale, window)
            attn = plain_norm(attn, eps).reshape(-1, q_dim) * torch.sigmoid(g)
            out = plain_norm(F.linear(attn.to(wdt), weights[p + "wo"]), c.post_norm_eps)
            x = residual_gated(x, out, weights[p + "attn_residual_gate"], c.residual_gate_temperature)
            h = offset_norm(x, weights[p + "mlp_norm"], eps).to(wdt)
            out = input_scaled_norm(self.mlp(weights, i, h), weights[p + "post_mlp_norm"], c.post_norm_eps)
            x = residual_gated(x, out, weights[p + "mlp_residual_gate"], c.residual_gate_temperature)
        x = plain_norm(x, eps) * weights["norm"].float()
        # lm_head(x) * output_multiplier == lm_head(x * output_multiplier); step_outputs then soft-caps.
        x = (x * c.output_multiplier).to(wdt)
        return self.outputs(x, weights, s, c.final_softcap)


# ---------------------------------------------------------------------- plain reference


def reference_logits(
    config: MuseSparkConfig, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights: logits [T, V] in fp32. The prompt's
    `images` replace their positions' (normed) input embeddings.

    Independent of the program path on purpose: unfused weights, no custom ops, explicit
    attention matrices and masks, experts looped over their chosen tokens with sorting instead
    of topk. Computed in float64, one weight converted at a time.
    """
    c = config
    f64 = torch.float64

    def w(name: str) -> Tensor:
        return hf_weights[name].to(f64)

    total = len(token_ids)
    ids = [0 if t in c.placeholder_ids else t for t in token_ids]

    def norm(t: Tensor, eps: float) -> Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    def gated(residual: Tensor, update: Tensor, gate: Tensor) -> Tensor:
        g = gate / c.residual_gate_temperature
        beta = 1.0 / (1.0 + (-g).exp())
        alpha = ((1.0 / (1.0 + g.exp())) * (1.0 + beta)).clamp(min=RESIDUAL_GATE_EPS).sqrt()
        return alpha * residual + beta * update

    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=f64) / c.head_dim))
    angles = torch.arange(total, dtype=f64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()  # [T, D/2]

    def rotate(t: Tensor) -> Tensor:  # [heads, T, D], rotary over (first half, second half) pairs
        a, b = t[..., : c.head_dim // 2], t[..., c.head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def mask(window: int) -> Tensor:  # [T, T] additive: key j visible to query i iff i - window < j <= i
        i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
        visible = (j <= i) & ((j > i - window) if window > 0 else torch.ones(total, total, dtype=torch.bool))
        return torch.zeros(total, total, dtype=f64).masked_fill(~visible, float("-inf"))

    def heads(t: Tensor, count: int) -> Tensor:  # [T, count * D] -> [count, T, D]
        return t.view(total, count, c.head_dim).transpose(0, 1)

    x = norm(w(_P + "embed_tokens.weight")[torch.tensor(ids)], c.rms_norm_eps)
    if images is not None:
        images.splice(x)
    group = c.num_heads // c.num_kv_heads
    for i, window in enumerate(c.layer_windows):
        p = _L.format(i)
        a = p + "self_attn."
        h = norm(x, c.rms_norm_eps) * (1.0 + w(p + "input_layernorm.weight"))
        q = norm(heads(h @ w(a + "q_proj.weight").T, c.num_heads), c.rms_norm_eps) * c.qk_scale_factor
        k = norm(heads(h @ w(a + "k_proj.weight").T, c.num_kv_heads), c.rms_norm_eps)
        v = heads(h @ w(a + "v_proj.weight").T, c.num_kv_heads)
        if c.layer_rope[i]:
            q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(c.head_dim) + mask(window)
        attn = norm(scores.softmax(-1) @ v, c.rms_norm_eps).transpose(0, 1).reshape(total, -1)
        attn = attn * torch.sigmoid(h @ w(a + "gate_proj.weight").T)
        out = norm(attn @ w(a + "o_proj.weight").T, c.post_norm_eps)
        x = gated(x, out, w(p + "post_attention_residual_gate.gate"))
        h = norm(x, c.rms_norm_eps) * (1.0 + w(p + "pre_feedforward_layernorm.weight"))
        mlp = _reference_moe(c, w, p + "mlp.", h) if c.layer_sparse[i] else _reference_swiglu(w, p + "mlp.", h)
        out = norm(mlp * (1.0 + w(p + "post_feedforward_layernorm.weight")), c.post_norm_eps)
        x = gated(x, out, w(p + "post_feedforward_residual_gate.gate"))
    x = norm(x, c.rms_norm_eps) * w(_P + "norm.weight")
    head = hf_weights["lm_head.weight"]
    logits = torch.cat([x @ rows.to(f64).T for rows in head.split(1 << 15)], dim=-1) * c.output_multiplier
    return (c.final_softcap * torch.tanh(logits / c.final_softcap)).float()


def _reference_swiglu(w, prefix: str, h: Tensor) -> Tensor:
    gate, up = h @ w(prefix + "gate_proj.weight").T, h @ w(prefix + "up_proj.weight").T
    return (gate / (1.0 + (-gate).exp()) * up) @ w(prefix + "down_proj.weight").T


def _reference_moe(c: MuseSparkConfig, w, prefix: str, h: Tensor) -> Tensor:
    """The MoE block: sigmoid router on the hidden-size input, experts at moe_hidden_size."""
    spec = c.router
    logits = h @ w(prefix + "gate.weight").T * c.output_multiplier
    probs = 1.0 / (1.0 + (-logits).exp())
    ids = (probs + w(prefix + "gate.e_score_correction_bias")).argsort(-1, descending=True)[:, : spec.top_k]
    top = probs.gather(1, ids)
    top = top / (top.sum(-1, keepdim=True) + spec.norm_eps) * spec.routed_scaling_factor
    z = h @ w(prefix + "pre_expert_proj.weight").T
    z = z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1.0 + w(prefix + "pre_expert_norm.weight"))
    gate_up, down = w(prefix + "experts.gate_up_proj"), w(prefix + "experts.down_proj")
    post_scale = 1.0 + w(prefix + "experts.post_expert_norm.weight")
    out = torch.zeros_like(z)
    for e in range(spec.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate, up = (z[rows] @ gate_up[e].T).chunk(2, dim=-1)
        y = (gate / (1.0 + (-gate).exp()) * up) @ down[e].T * post_scale
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + c.post_norm_eps)
        out.index_add_(0, rows, y * top[rows, slots, None])
    return out @ w(prefix + "post_expert_proj.weight").T


# ----------------------------------------------------------------------- test checkpoints

# No Muse Spark chat template is published where this project can read it (docs/export.md): test
# checkpoints use the qwen3 flavour, whose <think> reasoning matches the recipe's "think" syntax.
TEST_CHAT: str | None = "qwen3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny MuseSparkForConditionalGeneration config: 4 layers (sliding, full with rotary, sliding,
    full NoPE; window 8 < 16-token pages), one dense layer and three MoE layers of 8 sigmoid-routed
    experts top-2 at a width (48) other than hidden (64), softcap 4 so the tanh bites, and the last
    three vocabulary ids as the image/video/audio placeholders. Vision and audio configs are tiny
    so transformers can build the reference; their towers are not in the checkpoint. qk_scale_factor
    stays near 1: with random weights, sharper attention amplifies fp32 rounding so much that at 2.5
    transformers' own fp32 forward is already 7.5e-4 from a float64 one (the release uses 5.47)."""
    hidden = 64
    text = {
        "model_type": "muse_spark_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "post_norm_eps": 1e-8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_window": 8,
        "layer_types": [SLIDING, FULL, SLIDING, FULL],
        "mlp_layer_types": [SPARSE, DENSE, SPARSE, SPARSE],
        "final_logit_softcapping": 4.0,
        "qk_scale_factor": 1.2,
        "output_multiplier": 1.5,
        "hidden_act": "silu",
        "moe_intermediate_size": 32,
        "moe_hidden_size": 48,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "residual_gate_temperature": 0.3,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "muse_spark_vision",
        "patch_size": 14,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 16,
    }
    audio = {
        "model_type": "muse_spark_audio",
        "hidden_sizes": [8, 8, 8, 8],
        "depths": [1, 1, 1, 1],
        "num_hidden_layers": 4,
        "out_hidden_size": hidden,
    }
    return {
        "architectures": ["MuseSparkForConditionalGeneration"],
        "model_type": "muse_spark",
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "out_hidden_size": 128,
        "projector_hidden_size": 32,
        "image_token_id": vocab_size - 1,
        "video_token_id": vocab_size - 2,
        "audio_token_id": vocab_size - 3,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,  # testmodel's tokenizer_config reads it at the top level
        "torch_dtype": "float32",
        "text_only": True,  # the towers are not in the checkpoint (testmodel_vision drops this)
    }


def hf_shapes(c: MuseSparkConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of the text model (transformers 5's stacked expert layout),
    plus a multimodal config's vision tower, adapter and projection."""
    shapes = _text_shapes(c)
    return shapes | muse_spark_vision.hf_shapes(c.vision) if c.vision is not None else shapes


def _text_shapes(c: MuseSparkConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.kv_dim, c.intermediate_size
    m, e, fe = c.moe_hidden_size, c.router.num_experts, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        _P + "embed_tokens.weight": (c.vocab_size, h),
        _P + "norm.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
    }
    for layer, sparse in enumerate(c.layer_sparse):
        p = _L.format(layer)
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "pre_feedforward_layernorm.weight": (h,),
                p + "post_feedforward_layernorm.weight": (h,),
                p + "post_attention_residual_gate.gate": (h,),
                p + "post_feedforward_residual_gate.gate": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.gate_proj.weight": (q, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
        )
        if not sparse:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                }
            )
            continue
        shapes.update(
            {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.gate.e_score_correction_bias": (e,),
                p + "mlp.pre_expert_proj.weight": (m, h),
                p + "mlp.pre_expert_norm.weight": (m,),
                p + "mlp.experts.gate_up_proj": (e, 2 * fe, m),
                p + "mlp.experts.down_proj": (e, m, fe),
                p + "mlp.experts.post_expert_norm.weight": (m,),
                p + "mlp.post_expert_proj.weight": (h, m),
            }
        )
    return shapes


# Test vision checkpoints: the "muse_spark-vision" chat flavour (qwen3's tokens plus Muse Spark's
# image and video placeholders and framing).
TEST_VISION_CHAT = "muse_spark-vision"
TESTMODEL_VISION_TOKENS = (*vision_hooks.image_tokens(muse_spark_vision), "<|video|>")


def testmodel_vision(text: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """testmodel_config's checkpoint made multimodal: a 2-layer vision tower of width 32 (2 heads of 16:
    4 rotary frequencies per axis) over 14-pixel patches of 2 frames, a 4 x 4 position table (so
    4 x 4-patch windows on its window layer, several per image), 2 x 2 merging, an adapter of width
    48, the image and video placeholders at the chat flavour's <|patch|> and <|video|>. `tokens`:
    TESTMODEL_VISION_TOKENS -> ids."""
    config = {k: v for k, v in text.items() if k != "text_only"}
    config["vision_config"] = {
        "model_type": "muse_spark_vision",
        "patch_size": 14,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 16,
        "patch_temporal": 2,
        "merge_size": 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }
    config |= {
        "out_hidden_size": 128,
        "projector_hidden_size": 48,
        "image_token_id": tokens[muse_spark_vision.IMAGE_TOKEN],
        "video_token_id": tokens["<|video|>"],
    }
    return config


# MuseGlimmerImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json): at most
# 64 tokens of 28 x 28 pixels per image, LANCZOS, the class's mean / std (0.5).
TESTMODEL_PROCESSOR = {
    "image_processor_type": "MuseGlimmerImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "max_image_tokens": 64,
    "resample": 1,
    "image_mean": list(muse_spark_vision.PROCESSOR_DEFAULTS["image_mean"]),
    "image_std": list(muse_spark_vision.PROCESSOR_DEFAULTS["image_std"]),
}


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, TEST_VISION_CHAT, TESTMODEL_VISION_TOKENS, TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(muse_spark_vision)),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, vision=TINY_VISION),
    vision=vision_hooks.of(muse_spark_vision),
)
