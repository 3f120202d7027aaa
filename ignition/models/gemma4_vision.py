"""Gemma 4's vision tower and projector (Gemma4ForConditionalGeneration), as one exported program.

The `vision` program (helios.core.program.vision_signature) maps one image's patches to its soft
tokens already in the language model's embedding space:
    pixel_values [X, 3 * patch^2] fp32 in [0, 1]   (patch rows in (row, col, channel) order)
    pixel_positions [X, 2] int64                    ((x, y) patch coordinates; no padding rows)
    -> image_features [X / k^2, text hidden] fp32   (k = pooling kernel; pooled row-major)
Inside, as transformers' Gemma4VisionModel + Gemma4MultimodalEmbedder: patch embedding of
2 * (p - 0.5) plus learned x/y position tables, bidirectional encoder layers (Gemma 4 norms,
q/k RMSNorm, a weightless v norm, 2-D axial rotary, attention scale 1.0, GeLU-tanh MLP),
k x k average pooling by position times sqrt(hidden), optional standardization, then a
weightless RMSNorm and the projection to the text width.

The image *profile* (how helios turns an image into those patches, the token framing the chat
template's placeholder expands to, and the limits) is data in the manifest (vision_profile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models import vision_common as vc
from ignition.models.common import AttentionStack, rotate_half
from ignition.models.hf_config import Fields, Key
from ignition.models.patch_grid import raster_order

_V = "model.vision_tower."
_VL = _V + "encoder.layers.{}."
# Clipped linears (use_clipped_linears) carry scalar input/output bounds beside each weight.
_LINEARS = {
    **{f"self_attn.{p}_proj": f"w{p}" for p in "qkvo"},
    **{f"mlp.{p}_proj": f"w_{p}" for p in ("gate", "up", "down")},
}
WEIGHT_MAP = {
    _V + "patch_embedder.input_proj.weight": "vision.patch_proj",
    _V + "patch_embedder.position_embedding_table": "vision.pos_table",
    _V + "std_bias": "vision.std_bias",
    _V + "std_scale": "vision.std_scale",
    "model.embed_vision.embedding_projection.weight": "vision.projection",
    _VL + "input_layernorm.weight": "vision.layers.{}.attn_norm",
    _VL + "post_attention_layernorm.weight": "vision.layers.{}.post_attn_norm",
    _VL + "pre_feedforward_layernorm.weight": "vision.layers.{}.mlp_norm",
    _VL + "post_feedforward_layernorm.weight": "vision.layers.{}.post_mlp_norm",
    _VL + "self_attn.q_norm.weight": "vision.layers.{}.q_norm",
    _VL + "self_attn.k_norm.weight": "vision.layers.{}.k_norm",
    **{_VL + f"{hf}.linear.weight": f"vision.layers.{{}}.{ours}" for hf, ours in _LINEARS.items()},
    **{
        _VL + f"{hf}.{bound}": f"vision.layers.{{}}.{ours}.{bound}"
        for hf, ours in _LINEARS.items()
        for bound in ("input_min", "input_max", "output_min", "output_max")
    },
}

SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)  # the reference processor's max_soft_tokens values


@dataclass(frozen=True, slots=True)
class VisionConfig(AttentionStack):
    intermediate_size: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    standardize: bool
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    pad_token_id: int  # the per-layer-input id of image rows (transformers swaps image ids for pad)


# The fields read as they stand in vision_config, and the image token ids of the top level (with
# Gemma4VisionConfig's and Gemma4Config's defaults).
_FIELDS = Fields(
    VisionConfig,
    hidden_size=768,
    intermediate_size=3072,
    num_layers=Key("num_hidden_layers", 16),
    head_dim=Key("head_dim", 64, or_default=True),
    rms_norm_eps=1e-6,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=10240,
    standardize=False,
)
_TOKEN_FIELDS = Fields(VisionConfig, image_token_id=258_880, boi_token_id=255_999, eoi_token_id=258_882)


def config_from_hf(hf: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Gemma4Config dict (with its image token ids); unsupported variants raise ValueError."""
    v = hf["vision_config"]
    vc.activation(v, "hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh", "gelu_tanh"), "gemma4")
    rope = vc.axial_rope(v)
    if v.get("attention_bias"):
        raise ValueError("vision attention_bias is not supported by the gemma4 family")
    heads = int(v.get("num_attention_heads", 12))
    return VisionConfig(
        **_FIELDS.read(v),
        **_TOKEN_FIELDS.read(hf),
        num_heads=heads,
        num_kv_heads=int(v.get("num_key_value_heads") or heads),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        text_hidden_size=int(text.get("hidden_size", 2304)),
        pad_token_id=int(text.get("pad_token_id") if text.get("pad_token_id") is not None else 0),
    )


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, hd, ps = v.hidden_size, v.head_dim, v.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        _V + "patch_embedder.input_proj.weight": (h, 3 * ps * ps),
        _V + "patch_embedder.position_embedding_table": (2, v.position_embedding_size, h),
        "model.embed_vision.embedding_projection.weight": (v.text_hidden_size, h),
    }
    if v.standardize:
        shapes |= {_V + "std_bias": (h,), _V + "std_scale": (h,)}
    for i in range(v.num_layers):
        p = _VL.format(i)
        shapes |= {
            p + "self_attn.q_proj.linear.weight": (v.num_heads * hd, h),
            p + "self_attn.k_proj.linear.weight": (v.num_kv_heads * hd, h),
            p + "self_attn.v_proj.linear.weight": (v.num_kv_heads * hd, h),
            p + "self_attn.o_proj.linear.weight": (h, v.num_heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.linear.weight": (v.intermediate_size, h),
            p + "mlp.up_proj.linear.weight": (v.intermediate_size, h),
            p + "mlp.down_proj.linear.weight": (h, v.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "post_feedforward_layernorm.weight": (h,),
        }
    return shapes


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id=None) -> mf.VisionProfile:
    """The image profile helios prepares images by (resize rule, patches, pooling, normalization,
    framing) and the limits /v1/models advertises, from the checkpoint's processor config.
    `token_id` (the shared tower interface's) is unused: Gemma 4's framing ids are in its config."""
    ip = hf_processor.get("image_processor", hf_processor)
    soft = int(ip.get("max_soft_tokens", 280))
    if soft not in SOFT_TOKEN_CHOICES:
        raise ValueError(f"max_soft_tokens {soft} is not one of {SOFT_TOKEN_CHOICES}")
    if (
        int(ip.get("patch_size", v.patch_size)) != v.patch_size
        or int(ip.get("pooling_kernel_size", v.pooling_kernel_size)) != v.pooling_kernel_size
    ):
        raise ValueError("the processor's patch_size / pooling_kernel_size differ from the vision config's")
    return vc.image_profile(
        v,
        max_model_len,
        per_image=soft,
        smallest=1,
        framing=2,  # boi + eoi around each image's soft tokens
        rescale_factor=ip.get("rescale_factor", 1 / 255),
        normalized=vc.normalization(
            ip, ip.get("image_mean") or (0.0, 0.0, 0.0), ip.get("image_std") or (1.0, 1.0, 1.0), default=False
        ),
        prefix=(v.boi_token_id,),
        suffix=(v.eoi_token_id,),
        resize="aspect_ratio_patch_budget",
        patch_size=v.patch_size,
        pooling_kernel_size=v.pooling_kernel_size,
        max_patches=soft * v.pooling_kernel_size**2,
        resample="bicubic" if int(ip.get("resample", 3)) == 3 else "bilinear",
    )


# ---------------------------------------------------------------------------- the program


def _norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return out * weight.float() if weight is not None else out


def _linear(weights: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    """A (possibly clipped) linear: bounds are present in the weights only for clipped checkpoints."""
    if name + ".input_min" in weights:
        x = torch.clamp(x, weights[name + ".input_min"], weights[name + ".input_max"])
    y = F.linear(x.to(weights[name].dtype), weights[name]).float()
    if name + ".output_min" in weights:
        y = torch.clamp(y, weights[name + ".output_min"], weights[name + ".output_max"])
    return y


def _axial_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, head_dim]: the first half rotates by x, the second by y (H-H-W-W layout)."""
    inv = vc.inverse_frequencies(head_dim // 2, theta, positions)
    fx = positions[:, 0].float()[:, None] * inv[None, :]
    fy = positions[:, 1].float()[:, None] * inv[None, :]
    ang = torch.cat([fx, fx, fy, fy], dim=-1)
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def _rope2d(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary over each half of the head separately (transformers' apply_multidimensional_rope, ndim 2)."""
    half = t.shape[-1] // 2
    parts = []
    for k in range(2):
        x, c, s = (
            t[..., k * half : (k + 1) * half],
            cos[..., k * half : (k + 1) * half],
            sin[..., k * half : (k + 1) * half],
        )
        parts.append(x * c + rotate_half(x) * s)
    return torch.cat(parts, dim=-1)


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        eps, H, hd = v.rms_norm_eps, v.num_heads, v.head_dim
        wdt = weights["vision.patch_proj"].dtype
        x = F.linear((2.0 * (pixel_values.float() - 0.5)).to(wdt), weights["vision.patch_proj"]).float()
        table = weights["vision.pos_table"]
        x = x + (F.embedding(pixel_positions[:, 0], table[0]) + F.embedding(pixel_positions[:, 1], table[1])).float()
        cos, sin = _axial_cos_sin(pixel_positions, hd, v.rope_theta)
        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            h = _norm(x, weights[p + "attn_norm"], eps)
            q = _rope2d(_norm(_linear(weights, p + "wq", h).reshape(-1, H, hd), weights[p + "q_norm"], eps), cos, sin)
            k = _rope2d(
                _norm(_linear(weights, p + "wk", h).reshape(-1, v.num_kv_heads, hd), weights[p + "k_norm"], eps),
                cos,
                sin,
            )
            val = _norm(_linear(weights, p + "wv", h).reshape(-1, v.num_kv_heads, hd), None, eps)
            group = H // v.num_kv_heads
            k, val = k.repeat_interleave(group, dim=1), val.repeat_interleave(group, dim=1)
            attn = _linear(weights, p + "wo", vc.attention(q, k, val, scale=1.0))
            x = x + _norm(attn, weights[p + "post_attn_norm"], eps)
            h = _norm(x, weights[p + "mlp_norm"], eps)
            mlp = F.gelu(_linear(weights, p + "w_gate", h), approximate="tanh") * _linear(weights, p + "w_up", h)
            x = x + _norm(_linear(weights, p + "w_down", mlp), weights[p + "post_mlp_norm"], eps)
        k = v.pooling_kernel_size
        width = pixel_positions[:, 0].max() + 1  # patches per row
        kernel = torch.div(pixel_positions, k, rounding_mode="floor")
        index = kernel[:, 0] + torch.div(width, k, rounding_mode="floor") * kernel[:, 1]
        pooled = x.new_zeros(x.shape[0] // (k * k), x.shape[1]).index_add(0, index, x) / (k * k)
        pooled = pooled * v.hidden_size**0.5
        if v.standardize:
            pooled = (pooled - weights["vision.std_bias"].float()) * weights["vision.std_scale"].float()
        out = F.linear(_norm(pooled, None, eps).to(wdt), weights["vision.projection"]).float()
        return (out,)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """A 6 x 9 patch grid (2 x 3 pooled tokens with k = 3): every dim >= 2, so none specializes."""
    rows, cols = 2 * v.pooling_kernel_size, 3 * v.pooling_kernel_size
    pixels = torch.rand(rows * cols, 3 * v.patch_size**2, generator=torch.Generator().manual_seed(0))
    return pixels, raster_order(rows, cols)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 vision tower + projector over Hugging Face names, written apart from the program: an
    explicit attention matrix, the pooling as a one-hot averaging matrix. -> [X / k^2, text hidden] fp32."""
    f64 = torch.float64
    w = lambda name: hf[name].to(f64)
    eps = v.rms_norm_eps

    def norm(t: Tensor, weight: Tensor | None) -> Tensor:
        out = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return out * weight if weight is not None else out

    def lin(t: Tensor, name: str) -> Tensor:
        prefix = name[: -len(".linear.weight")]
        if prefix + ".input_min" in hf:
            t = t.clamp(float(hf[prefix + ".input_min"]), float(hf[prefix + ".input_max"]))
        y = t @ w(name).T
        if prefix + ".output_min" in hf:
            y = y.clamp(float(hf[prefix + ".output_min"]), float(hf[prefix + ".output_max"]))
        return y

    X, hd, H = pixels.shape[0], v.head_dim, v.num_heads
    table = w(_V + "patch_embedder.position_embedding_table")
    x = (2.0 * (pixels.to(f64) - 0.5)) @ w(_V + "patch_embedder.input_proj.weight").T
    x = x + table[0][positions[:, 0]] + table[1][positions[:, 1]]
    spatial = hd // 2
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=f64) / spatial))

    def rotate(t: Tensor) -> Tensor:  # [X, heads, hd]
        out = []
        for axis in range(2):
            part = t[..., axis * spatial : (axis + 1) * spatial]
            ang = positions[:, axis].to(f64)[:, None] * inv[None, :]
            cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
            a, b = part[..., : spatial // 2], part[..., spatial // 2 :]
            out.append(torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1))
        return torch.cat(out, dim=-1)

    for i in range(v.num_layers):
        p = _VL.format(i)
        h = norm(x, w(p + "input_layernorm.weight"))
        q = rotate(norm(lin(h, p + "self_attn.q_proj.linear.weight").view(X, H, hd), w(p + "self_attn.q_norm.weight")))
        k = rotate(norm(lin(h, p + "self_attn.k_proj.linear.weight").view(X, -1, hd), w(p + "self_attn.k_norm.weight")))
        val = norm(lin(h, p + "self_attn.v_proj.linear.weight").view(X, -1, hd), None)
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        val = val.repeat_interleave(H // val.shape[1], dim=1)
        attn = vc.reference_attention(q, k, val, scale=1.0).reshape(X, H * hd)
        x = x + norm(lin(attn, p + "self_attn.o_proj.linear.weight"), w(p + "post_attention_layernorm.weight"))
        h = norm(x, w(p + "pre_feedforward_layernorm.weight"))
        mlp = vc.reference_activation(lin(h, p + "mlp.gate_proj.linear.weight"), "gelu_pytorch_tanh")
        mlp = mlp * lin(h, p + "mlp.up_proj.linear.weight")
        x = x + norm(lin(mlp, p + "mlp.down_proj.linear.weight"), w(p + "post_feedforward_layernorm.weight"))
    kk = v.pooling_kernel_size
    cols = int(positions[:, 0].max()) + 1
    target = (positions[:, 0] // kk) + (cols // kk) * (positions[:, 1] // kk)
    average = F.one_hot(target, X // (kk * kk)).to(f64).T / (kk * kk)  # [tokens, X]
    pooled = (average @ x) * math.sqrt(v.hidden_size)
    if v.standardize:
        pooled = (pooled - w(_V + "std_bias")) * w(_V + "std_scale")
    return (norm(pooled, None) @ w("model.embed_vision.embedding_projection.weight").T).float()
