"""GLM-5.3-Flash's vision tower and patch merger (Glm5NextModel.visual), one program.

The `vision` program maps one image's patch clips in merge-block order (vision_common's ClipTower
layout, as transformers' Glm5NextImageProcessor lays them out) to one token per m x m block. Inside, as transformers 5.24's Glm5NextVisionModel:
the Conv3d patch embedding (a linear over each patch row, with bias), blocks of RMSNorm, attention
(fused qkv, per-head RMSNorm of q and k, a 2-D rotary over the whole head: head_dim / 4 frequencies
of y then of x, repeated for rotate-half), RMSNorm and a clamped SwiGLU MLP; a final RMSNorm; each
merge block's m^2 rows through the Conv2d downsample to out_hidden_size; then the merger: a linear,
LayerNorm, GELU, and a clamped SwiGLU. The language model is NoPE, so image tokens need no
positions of their own. The image profile (GLM's fit_and_pad resize, normalization, limits) is data
in the manifest (profile()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models import vision_common as vc
from ignition.models.hf_config import Fields, Key
from ignition.models.naming import with_biases
from ignition.models.patch_grid import still_clip_example

_V = "model.visual."
_B = _V + "blocks.{}."
_M = _V + "merger."
# transformers' layout (what Glm5NextForConditionalGeneration.state_dict() holds and GLM ships).
WEIGHT_MAP = {
    **with_biases(_V, "vision.", (("patch_embed.proj", "patch_embed"), ("downsample", "downsample"))),
    _V + "post_layernorm.weight": "vision.post_norm",
    _M + "proj.weight": "vision.merger.proj",
    _M + "post_projection_norm.weight": "vision.merger.norm",
    _M + "post_projection_norm.bias": "vision.merger.norm.bias",
    _M + "gate_proj.weight": "vision.merger.gate",
    _M + "up_proj.weight": "vision.merger.up",
    _M + "down_proj.weight": "vision.merger.down",
    _B + "norm1.weight": "vision.layers.{}.norm1",
    _B + "norm2.weight": "vision.layers.{}.norm2",
    _B + "attn.q_norm.weight": "vision.layers.{}.q_norm",
    _B + "attn.k_norm.weight": "vision.layers.{}.k_norm",
    **with_biases(
        _B,
        "vision.layers.{}.",
        (
            ("attn.qkv", "wqkv"),
            ("attn.proj", "wo"),
            ("mlp.gate_proj", "w_gate"),
            ("mlp.up_proj", "w_up"),
            ("mlp.down_proj", "w_down"),
        ),
    ),
}
ACTIVATIONS = ("silu", "gelu")
DEFAULT_IMAGE_TOKEN_ID = 154854  # Glm5NextConfig.image_token_id


@dataclass(frozen=True, slots=True)
class VisionConfig(vc.ClipTower):
    rms_norm_eps: float
    rope_theta: float
    hidden_act: str  # one of ACTIVATIONS (the MLPs' and the merger's SwiGLU gate)
    attention_bias: bool  # biases of qkv, proj and the block MLPs
    swiglu_limit: float  # gate <= limit, |up| <= limit (block MLPs and the merger)
    projection_intermediate_size: int  # the merger's SwiGLU width


def image_token_id(top: dict[str, Any]) -> int:
    return int(top.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))


# The fields read as they stand in vision_config (with Glm5NextVisionConfig's defaults).
_FIELDS = Fields(
    VisionConfig,
    intermediate_size=4096,
    num_layers=Key(("depth", "num_hidden_layers"), 24),
    rms_norm_eps=1e-5,
    attention_bias=True,
    patch_size=14,
    temporal_patch_size=2,
    merge_size=Key("spatial_merge_size", 2),
    projection_intermediate_size=10240,
)


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Glm5NextConfig dict, as transformers reads it; unsupported variants raise ValueError."""
    v = top["vision_config"]
    act = vc.activation(v, "hidden_act", "silu", ACTIVATIONS, "glm5_next")
    theta = vc.axial_theta(v)
    vc.check_rgb(v, "in_channels")
    hidden = int(v.get("hidden_size", 1024))
    heads = int(v.get("num_heads", v.get("num_attention_heads", 16)))
    vc.check_heads(hidden, heads)
    text_hidden = int(text.get("hidden_size", 4096))
    out = int(v.get("out_hidden_size", 1536))
    if out != text_hidden:
        raise ValueError(f"vision out_hidden_size {out} differs from the text hidden_size {text_hidden}")
    limit = float(v.get("swiglu_limit", 10.0) or 0.0)
    if limit <= 0:
        raise ValueError(f"vision swiglu_limit {limit} must be positive")
    for name in ("patch_size", "temporal_patch_size"):
        if isinstance(v.get(name), (list, tuple)):
            raise ValueError(f"vision {name} {v[name]!r}: only a single integer is supported")
    return VisionConfig(
        **_FIELDS.read(v),
        hidden_size=hidden,
        num_heads=heads,
        rope_theta=theta,
        hidden_act=act,
        swiglu_limit=limit,
        text_hidden_size=text_hidden,
        image_token_id=image_token_id(top),
    )


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, f, o, p, m = v.hidden_size, v.intermediate_size, v.text_hidden_size, v.projection_intermediate_size, v.merge_size
    shapes: dict[str, tuple[int, ...]] = {
        _V + "patch_embed.proj.weight": (h, 3, v.temporal_patch_size, v.patch_size, v.patch_size),
        _V + "patch_embed.proj.bias": (h,),
        _V + "post_layernorm.weight": (h,),
        _V + "downsample.weight": (o, h, m, m),
        _V + "downsample.bias": (o,),
        _M + "proj.weight": (o, o),
        _M + "post_projection_norm.weight": (o,),
        _M + "post_projection_norm.bias": (o,),
        _M + "gate_proj.weight": (p, o),
        _M + "up_proj.weight": (p, o),
        _M + "down_proj.weight": (o, p),
    }
    for i in range(v.num_layers):
        b = _B.format(i)
        layer = {
            "norm1.weight": (h,),
            "norm2.weight": (h,),
            "attn.q_norm.weight": (v.head_dim,),
            "attn.k_norm.weight": (v.head_dim,),
            "attn.qkv.weight": (3 * h, h),
            "attn.proj.weight": (h, h),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        if v.attention_bias:
            layer |= {
                "attn.qkv.bias": (3 * h,),
                "attn.proj.bias": (h,),
                "mlp.gate_proj.bias": (f,),
                "mlp.up_proj.bias": (f,),
                "mlp.down_proj.bias": (h,),
            }
        shapes |= {b + name: shape for name, shape in layer.items()}
    return shapes


# Glm5NextImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = vc.processor_defaults(
    vc.CLIP_MEAN, vc.CLIP_STD, patch_expand_factor=1, min_image_tokens=16, max_image_tokens=8000
)
IMAGE_TOKEN, START_TOKEN, END_TOKEN = "<|image|>", "<|begin_of_image|>", "<|end_of_image|>"


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (fit_and_pad token bounds, normalization, limits) from the checkpoint's
    processor config; `token_id(text) -> id | None` resolves the framing tokens in its tokenizer.
    GLM's template renders <|begin_of_image|><|image|><|end_of_image|> itself, so the placeholder
    <|image|> expands to the image tokens alone."""
    ip, settings = vc.processor_settings(hf_processor, PROCESSOR_DEFAULTS)
    vc.check_patching(settings, v, ("patch_size", "temporal_patch_size", "merge_size"))
    if int(settings["patch_expand_factor"]) != 1:
        raise ValueError(f"patch_expand_factor {settings['patch_expand_factor']} is not supported (1 is)")
    vc.check_resample(settings["resample"], 3, "bicubic")
    vc.check_switches(ip)
    ps, m = int(settings["patch_size"]), int(settings["merge_size"])
    low, high = int(settings["min_image_tokens"]), int(settings["max_image_tokens"])
    if not 0 < low <= high or high < 2:
        raise ValueError(f"min_image_tokens {low} / max_image_tokens {high} must bound at least two tokens")
    vc.framing_ids(token_id, IMAGE_TOKEN, (START_TOKEN, END_TOKEN), v)
    framing = 2  # the template's begin/end of image around each image's tokens
    factor = ps * m
    per_image = max(0, min(high, max_model_len - 1 - framing))
    return vc.image_profile(
        v,
        max_model_len,
        per_image=per_image,
        smallest=max(2, low),
        framing=framing,
        rescale_factor=settings["rescale_factor"],
        normalized=vc.normalization(ip, settings["image_mean"], settings["image_std"]),
        resize="fit_and_pad",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=per_image * m * m,
        resample="torch_bicubic",
        min_pixels=low * factor**2,  # the token bounds as canvas areas (the frames cancel out of GLM's rule)
        max_pixels=high * factor**2,
        temporal_patch_size=v.temporal_patch_size,
    )


# ---------------------------------------------------------------------------- the program


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, H, hd, eps, limit = v.hidden_size, v.num_heads, v.head_dim, v.rms_norm_eps, v.swiglu_limit
        patch = weights["vision.patch_embed"]  # [h, 3, t, p, p]: a linear over (channel, frame, row, col) rows
        lin = vc.Linears(weights, patch.dtype)

        def swiglu(prefix: str, x: Tensor) -> Tensor:
            gate = lin(prefix + "gate", x).clamp(max=limit)
            up = lin(prefix + "up", x).clamp(-limit, limit)
            return lin(prefix + "down", vc.activation_fn(v.hidden_act, gate) * up)

        x = F.linear(pixel_values.to(patch.dtype), patch.reshape(h, -1), weights["vision.patch_embed.bias"]).float()
        # head_dim / 4 frequencies of y, then of x, as Glm5NextVisionRotaryEmbedding.
        cos_sin = vc.axial_cos_sin(pixel_positions[:, 1], pixel_positions[:, 0], hd, v.rope_theta)
        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            q, k, val = lin(p + "wqkv", _rms(x, weights[p + "norm1"], eps)).reshape(-1, 3, H, hd).unbind(1)
            q, k = _rms(q, weights[p + "q_norm"], eps), _rms(k, weights[p + "k_norm"], eps)
            x = x + lin(p + "wo", vc.attention(vc.apply_rotary(q, *cos_sin), vc.apply_rotary(k, *cos_sin), val))
            x = x + swiglu(p + "w_", _rms(x, weights[p + "norm2"], eps))
        x = _rms(x, weights["vision.post_norm"], eps)
        # Each merge block's m^2 rows side by side: the Conv2d over the block is a linear over its
        # (row, col, channel) values.
        down = weights["vision.downsample"]  # [out, h, m, m]
        x = F.linear(
            vc.merge_blocks(x, v.merge_size).flatten(1).to(patch.dtype),
            down.permute(0, 2, 3, 1).reshape(down.shape[0], -1),
            weights["vision.downsample.bias"],
        ).float()
        x = lin("vision.merger.proj", x)
        o = v.text_hidden_size
        x = F.gelu(
            F.layer_norm(x, (o,), weights["vision.merger.norm"].float(), weights["vision.merger.norm.bias"].float())
        )
        return (swiglu("vision.merger.", x),)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """A 4 x 6 patch grid (2 x 3 tokens at m = 2) of still frames (patch_grid.still_clip_example)."""
    return still_clip_example(v.merge_size, v.patch_size, v.temporal_patch_size)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 tower + merger over Hugging Face names, written apart from the program: the patches
    reassembled into a clip for a real Conv3d, rotary angles pair by pair, an explicit attention
    matrix, the grid downsampled by a real Conv2d. -> [X / m^2, text hidden] fp32, one row per
    merge block, blocks row-major."""
    f64 = torch.float64

    def w(name: str) -> Tensor:
        return hf[name].to(f64)

    def b(name: str) -> Tensor | float:
        return hf[name].to(f64) if name in hf else 0.0

    ps, t, h, H, m, limit = (
        v.patch_size,
        v.temporal_patch_size,
        v.hidden_size,
        v.num_heads,
        v.merge_size,
        v.swiglu_limit,
    )
    hd = h // H
    rows, cols = vc.reference_grid(positions)
    clip = vc.reference_clip(pixels, positions, ps, t)
    grid = F.conv3d(clip[None], w(_V + "patch_embed.proj.weight"), w(_V + "patch_embed.proj.bias"), stride=(t, ps, ps))
    x = grid[0, :, 0].flatten(1).T  # [rows * cols, h] row-major

    def rms(u: Tensor, name: str) -> Tensor:
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + v.rms_norm_eps) * w(name)

    def swiglu(u: Tensor, prefix: str) -> Tensor:
        gate = (u @ w(prefix + "gate_proj.weight").T + b(prefix + "gate_proj.bias")).clamp(max=limit)
        up = (u @ w(prefix + "up_proj.weight").T + b(prefix + "up_proj.bias")).clamp(-limit, limit)
        return (vc.reference_activation(gate, v.hidden_act) * up) @ w(prefix + "down_proj.weight").T + b(
            prefix + "down_proj.bias"
        )

    # Channel pairs (j, j + hd/2) turn by angle[j]: hd/4 frequencies of the row y, then of the column x.
    quarter = hd // 4
    freqs = [v.rope_theta ** (-2 * j / (hd // 2)) for j in range(quarter)]
    angle = torch.tensor(
        [[r * f for f in freqs] + [c * f for f in freqs] for r in range(rows) for c in range(cols)], dtype=f64
    )
    for i in range(v.num_layers):
        p = _B.format(i)
        qkv = rms(x, p + "norm1.weight") @ w(p + "attn.qkv.weight").T + b(p + "attn.qkv.bias")
        q, k, val = qkv.view(-1, 3, H, hd).unbind(1)
        q = vc.reference_rotate(rms(q, p + "attn.q_norm.weight"), angle)
        k = vc.reference_rotate(rms(k, p + "attn.k_norm.weight"), angle)
        attn = vc.reference_attention(q, k, val).reshape(-1, h)
        x = x + attn @ w(p + "attn.proj.weight").T + b(p + "attn.proj.bias")
        x = x + swiglu(rms(x, p + "norm2.weight"), p + "mlp.")
    x = rms(x, _V + "post_layernorm.weight")
    tokens = F.conv2d(x.T.reshape(1, h, rows, cols), w(_V + "downsample.weight"), w(_V + "downsample.bias"), stride=m)
    x = tokens[0].flatten(1).T  # [blocks row-major, out]
    x = x @ w(_M + "proj.weight").T
    x = F.layer_norm(x, (x.shape[-1],), w(_M + "post_projection_norm.weight"), w(_M + "post_projection_norm.bias"))
    return swiglu(vc.reference_activation(x, "gelu"), _M).float()
