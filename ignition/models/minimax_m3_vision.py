"""MiniMax M3's vision tower and projector (MiniMaxM3VLModel's vision_tower + multi_modal_projector), one program.

The `vision` program (helios.core.program.vision_signature) maps one image to its tokens in the
language model's embedding space:
    pixel_values [X, 3 * t * patch^2] fp32, normalized   (each patch's pixels in (channel, frame, row,
                                                           col) order, the still image repeated over
                                                           t = temporal_patch_size frames)
    pixel_positions [X, 2] int64                           ((x, y) patch coordinates)
    -> image_features [X / m^2, text hidden] fp32          (one row per m x m merge block)
Patches come in merge-block order, as transformers' MiniMaxM3VLImageProcessor lays them out: the
m x m blocks row-major, the patches of a block row-major inside it; so block b's patches are rows
m^2 b .. m^2 b + m^2 - 1 and its token is row b. Inside, as transformers 5.24's MiniMaxM3VLVisionModel
and MiniMaxM3VLMultiModalProjector: the Conv3d patch embedding (a linear over each patch row, no
bias), a pre-LayerNorm, encoder layers (LayerNorm, MHA with biases and a partial 3-D rotary over the
(frame, y, x) axes, LayerNorm, GELU MLP), no final norm; then the projector: a GELU MLP per patch
into the text width, each block's m^2 rows concatenated, and a second GELU MLP to one token. The
temporal position of a still image is 0, so (x, y) positions are all the tower needs. The image
profile (smart_resize bounds, normalization, framing, limits) is data in the manifest (profile()).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models.common import rotate_half
from ignition.models.naming import biased_shapes, with_biases
from ignition.models.patch_grid import still_clip_example

_V = "model.vision_tower."
_VL = _V + "layers.{}."
_PROJ = "model.multi_modal_projector."
# transformers' in-memory layout (what MiniMaxM3SparseForConditionalGeneration.state_dict() holds).
WEIGHT_MAP = {
    _V + "embeddings.proj.weight": "vision.patch_embed",
    _V + "pre_layrnorm.weight": "vision.pre_norm",
    _V + "pre_layrnorm.bias": "vision.pre_norm.bias",
    **with_biases(
        _PROJ,
        "vision.",
        (
            ("linear_1", "proj1"),
            ("linear_2", "proj2"),
            ("merge_linear_1", "merge1"),
            ("merge_linear_2", "merge2"),
        ),
    ),
    **with_biases(
        _VL,
        "vision.layers.{}.",
        (
            ("self_attn.q_proj", "wq"),
            ("self_attn.k_proj", "wk"),
            ("self_attn.v_proj", "wv"),
            ("self_attn.out_proj", "wo"),
            ("mlp.fc1", "fc1"),
            ("mlp.fc2", "fc2"),
            ("layer_norm1", "norm1"),
            ("layer_norm2", "norm2"),
        ),
    ),
}
# MiniMax's own layout (what its hub checkpoints ship) -> transformers' names, as transformers'
# conversion_mapping "minimax_m3_vl" renames them.
_HUB_RENAMES = (
    (r"^vision_tower\.vision_model\.embeddings\.patch_embedding\.", _V + "embeddings.proj."),
    (r"^vision_tower\.vision_model\.encoder\.layers\.", _V + "layers."),
    (r"^vision_tower\.vision_model\.pre_layrnorm\.", _V + "pre_layrnorm."),
    (r"^multi_modal_projector\.linear_([12])\.", _PROJ + r"linear_\1."),
    (r"^patch_merge_mlp\.linear_([12])\.", _PROJ + r"merge_linear_\1."),
)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", _V, _PROJ)
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu")
DEFAULT_IMAGE_TOKEN_ID = 200025  # MiniMaxM3VLConfig.image_token_index


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    rope_theta: float
    hidden_act: str  # one of ACTIVATIONS (the tower's MLP; the projector's is always exact GELU)
    patch_size: int
    temporal_patch_size: int  # frames per patch; a still image is repeated over them
    merge_size: int  # m: m x m patches merge into one token
    projector_hidden_size: int
    text_hidden_size: int
    image_token_id: int

    @property
    def pooling_kernel_size(self) -> int:
        """Patches per token side (the profile's pooling_kernel_size): the spatial merge."""
        return self.merge_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def axis_dim(self) -> int:
        """Rotated channels per axis (frame, y, x): 2 * ((head_dim // 3) // 2); the rotary covers
        3 * axis_dim channels, the rest pass through."""
        return 2 * ((self.head_dim // 3) // 2)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


def image_token_id(top: dict[str, Any]) -> int:
    """The image placeholder id of a MiniMaxM3VLConfig dict (either spelling, else the class default)."""
    return int(top.get("image_token_id", top.get("image_token_index", DEFAULT_IMAGE_TOKEN_ID)))


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a MiniMaxM3VLConfig dict, as transformers reads it; unsupported variants
    raise ValueError."""
    v = top["vision_config"]
    act = v.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {act!r} is not supported by the minimax_m3 family ({ACTIVATIONS})")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported (axial is)")
    if int(v.get("num_channels", 3)) != 3:
        raise ValueError("vision num_channels other than 3 is not supported")
    hidden, heads = int(v.get("hidden_size", 1280)), int(v.get("num_attention_heads", 16))
    if hidden % heads or (hidden // heads) // 3 < 2:
        raise ValueError(f"vision hidden_size {hidden} over {heads} heads leaves no rotary channels per axis")
    text_hidden = int(text.get("hidden_size", 6144))
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 5120)),
        num_layers=int(v.get("num_hidden_layers", 32)),
        num_heads=heads,
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        hidden_act=act,
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=int(v.get("spatial_merge_size", 2)),
        projector_hidden_size=int(top.get("projector_hidden_size", 6144)),
        text_hidden_size=text_hidden,
        image_token_id=image_token_id(top),
    )


def native_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's tensors with MiniMax's vision layout renamed to transformers' (others untouched)."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _HUB_RENAMES:
            renamed = re.sub(pattern, replacement, name)
            if renamed != name:
                name = renamed
                break
        out[name] = tensor
    return out


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, f, p, t = v.hidden_size, v.intermediate_size, v.projector_hidden_size, v.text_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        _V + "embeddings.proj.weight": (h, 3, v.temporal_patch_size, v.patch_size, v.patch_size),
        _V + "pre_layrnorm.weight": (h,),
        _V + "pre_layrnorm.bias": (h,),
        _PROJ + "linear_1.weight": (p, h),
        _PROJ + "linear_1.bias": (p,),
        _PROJ + "linear_2.weight": (t, p),
        _PROJ + "linear_2.bias": (t,),
        _PROJ + "merge_linear_1.weight": (p, t * v.merge_size**2),
        _PROJ + "merge_linear_1.bias": (p,),
        _PROJ + "merge_linear_2.weight": (t, p),
        _PROJ + "merge_linear_2.bias": (t,),
    }
    for i in range(v.num_layers):
        q = _VL.format(i)
        shapes |= biased_shapes(
            q, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"), h, h
        )
        shapes |= biased_shapes(q, ("mlp.fc1",), f, h) | biased_shapes(q, ("mlp.fc2",), h, f)
        shapes |= biased_shapes(q, ("layer_norm1", "layer_norm2"), h)
    return shapes


# MiniMaxM3VLImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = {
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 451584,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
    "rescale_factor": 1 / 255,
    "resample": 3,
}
IMAGE_TOKEN, START_TOKEN, END_TOKEN = "]<]image[>[", "]<]start of image[>[", "]<]end of image[>["


def _pixel_bounds(ip: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) as MiniMaxM3VLImageProcessor.__init__ resolves them: size's
    shortest_edge / longest_edge, overridden by min_pixels / max_pixels; the hub's stale
    size [672, 672] means the class default."""
    size = ip.get("size")
    low, high = PROCESSOR_DEFAULTS["min_pixels"], PROCESSOR_DEFAULTS["max_pixels"]
    if isinstance(size, dict):
        low, high = int(size.get("shortest_edge", low)), int(size.get("longest_edge", high))
    elif size is not None and list(size) != [672, 672]:
        raise ValueError(f"size {size!r} is not a {{shortest_edge, longest_edge}} pixel range")
    low = int(ip["min_pixels"]) if ip.get("min_pixels") is not None else low
    high = int(ip["max_pixels"]) if ip.get("max_pixels") is not None else high
    return low, high


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (smart_resize bounds, normalization, framing, limits) from the checkpoint's
    processor config; `token_id(text) -> id | None` resolves the framing tokens in its tokenizer."""
    ip = hf_processor.get("image_processor", hf_processor)
    settings = {k: ip.get(k) if ip.get(k) is not None else d for k, d in PROCESSOR_DEFAULTS.items()}
    ps, t, m = int(settings["patch_size"]), int(settings["temporal_patch_size"]), int(settings["merge_size"])
    if (ps, t, m) != (v.patch_size, v.temporal_patch_size, v.merge_size):
        raise ValueError(
            f"the processor's patch_size / temporal_patch_size / merge_size ({ps}, {t}, {m}) differ "
            f"from the vision tower's ({v.patch_size}, {v.temporal_patch_size}, {v.merge_size})"
        )
    if int(settings["resample"]) != 3:
        raise ValueError(f"resample {settings['resample']} is not supported (bicubic, 3, is)")
    if ip.get("do_rescale") is False or ip.get("do_convert_rgb") is False or ip.get("do_resize") is False:
        raise ValueError("do_rescale, do_resize and do_convert_rgb must stay on")
    low, high = _pixel_bounds(ip)
    factor = ps * m
    if not 0 < low <= high or high < 2 * factor**2:
        raise ValueError(f"min_pixels {low} / max_pixels {high} must bound at least two {factor}x{factor} tokens")
    normalize = ip.get("do_normalize", True)
    ids = {text: token_id(text) for text in (IMAGE_TOKEN, START_TOKEN, END_TOKEN)}
    missing = [text for text, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the image framing tokens {missing}")
    if ids[IMAGE_TOKEN] != v.image_token_id:
        raise ValueError(f"image_token_id {v.image_token_id} is not the tokenizer's {IMAGE_TOKEN} ({ids[IMAGE_TOKEN]})")
    framing = 2  # start + end of image around each image's tokens
    # smart_resize keeps an image's area within max_pixels except at extreme aspect ratios (a side
    # floored to one factor); those cost more and are refused against this per request.
    per_image = max(0, min(high // factor**2, max_model_len - 1 - framing))
    smallest = max(2, low // factor**2)
    return mf.VisionProfile(
        resize="smart_resize",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=per_image * m * m,
        resample="torch_bicubic",
        rescale_factor=float(settings["rescale_factor"]),
        image_mean=tuple(float(x) for x in settings["image_mean"]) if normalize else (0.0, 0.0, 0.0),
        image_std=tuple(float(x) for x in settings["image_std"]) if normalize else (1.0, 1.0, 1.0),
        placeholder_token_id=v.image_token_id,  # the template renders one ]<]image[>[ per image
        image_token_id=v.image_token_id,
        prefix_token_ids=(ids[START_TOKEN],),
        suffix_token_ids=(ids[END_TOKEN],),
        feature_dim=v.text_hidden_size,
        max_images_per_prompt=max(0, (max_model_len - 1) // (smallest + framing)),
        max_image_tokens_per_prompt=max(0, max_model_len - 1 - framing),
        image_feature_window_tokens=per_image,
        max_image_tokens_per_image=per_image,
        max_image_pixels=50_000_000,
        max_image_bytes=20 << 20,
        min_pixels=low,
        max_pixels=high,
        temporal_patch_size=t,
    )


# ---------------------------------------------------------------------------- the program


def _activation(name: str, x: Tensor) -> Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def _rotary_cos_sin(positions: Tensor, v: VisionConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, 3 * axis_dim]: angles by (frame 0, y, x) per axis_dim / 2 frequencies, the set
    repeated for rotate-half, as MiniMaxM3VLVisionRotaryEmbedding."""
    d = v.axis_dim
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d))
    y = positions[:, 1].float()[:, None] * inv
    ang = torch.cat([torch.zeros_like(y), y, positions[:, 0].float()[:, None] * inv], dim=-1)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    width = cos.shape[-1]
    rot, rest = x[..., :width], x[..., width:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class VisionProgram(torch.nn.Module):
    """forward(weights, kv_cache, pixel_values, pixel_positions) -> (image_features,); kv_cache is unused (empty)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, H, hd, eps = v.hidden_size, v.num_heads, v.head_dim, v.layer_norm_eps
        patch = weights["vision.patch_embed"]  # [h, 3, t, p, p]: a linear over (channel, frame, row, col) rows
        wdt = patch.dtype
        x = F.linear(pixel_values.to(wdt), patch.reshape(h, -1)).float()
        x = F.layer_norm(x, (h,), weights["vision.pre_norm"].float(), weights["vision.pre_norm.bias"].float(), eps)
        cos, sin = _rotary_cos_sin(pixel_positions, v)

        def lin(name: str, t: Tensor) -> Tensor:
            return F.linear(t.to(wdt), weights[name], weights[name + ".bias"]).float()

        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            y = F.layer_norm(x, (h,), weights[p + "norm1"].float(), weights[p + "norm1.bias"].float(), eps)
            q, k, val = (lin(p + name, y).reshape(-1, H, hd) for name in ("wq", "wk", "wv"))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), val.transpose(0, 1))
            x = x + lin(p + "wo", attn.transpose(0, 1).reshape(-1, h))
            y = F.layer_norm(x, (h,), weights[p + "norm2"].float(), weights[p + "norm2.bias"].float(), eps)
            x = x + lin(p + "fc2", _activation(v.hidden_act, lin(p + "fc1", y)))
        x = lin("vision.proj2", F.gelu(lin("vision.proj1", x)))  # [X, text hidden]
        # Each merge block's m^2 consecutive rows side by side, gathered so every shape follows X.
        group = v.merge_size**2
        n = x.shape[0] // group
        rows = torch.arange(n, device=x.device)[:, None] * group + torch.arange(group, device=x.device)[None, :]
        x = x[rows].reshape(n, group * v.text_hidden_size)
        return (lin("vision.merge2", F.gelu(lin("vision.merge1", x))),)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """A 4 x 6 patch grid (2 x 3 tokens at m = 2) of still frames (patch_grid.still_clip_example)."""
    return still_clip_example(v.merge_size, v.patch_size, v.temporal_patch_size)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 tower + projector over Hugging Face names, written apart from the program: the
    patches reassembled into a clip for a real Conv3d, rotary angles pair by pair, an explicit
    attention matrix, and the merge blocks read off the grid by position. -> [X / m^2, text hidden]
    fp32, one row per merge block, blocks row-major."""
    f64 = torch.float64
    w = lambda name: hf[name].to(f64)  # noqa: E731
    ps, t, h, H, m = v.patch_size, v.temporal_patch_size, v.hidden_size, v.num_heads, v.merge_size
    hd = h // H
    rows, cols = int(positions[:, 1].max()) + 1, int(positions[:, 0].max()) + 1
    clip = torch.zeros(3, t, rows * ps, cols * ps, dtype=f64)
    for (x, y), patch in zip(positions.tolist(), pixels.to(f64)):
        clip[:, :, y * ps : (y + 1) * ps, x * ps : (x + 1) * ps] = patch.view(3, t, ps, ps)
    grid = F.conv3d(clip[None], w(_V + "embeddings.proj.weight"), stride=(t, ps, ps))[0, :, 0]  # [h, rows, cols]
    x = grid.flatten(1).T  # [rows * cols, h] row-major

    def ln(u: Tensor, name: str) -> Tensor:
        return F.layer_norm(u, (h,), w(name + ".weight"), w(name + ".bias"), v.layer_norm_eps)

    def act(u: Tensor, name: str) -> Tensor:
        if name == "quick_gelu":
            return u / (1 + torch.exp(-1.702 * u))
        if name == "gelu_pytorch_tanh":
            return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))

    # Channel pairs (j, j + 3d/2) turn by angle[j]; angles: d/2 frequencies of the frame (0), then y, then x.
    d = v.axis_dim
    freqs = [v.rope_theta ** (-j / d) for j in range(0, d, 2)]
    angle = torch.tensor(
        [
            [0.0 * f for f in freqs] + [r * f for f in freqs] + [c * f for f in freqs]
            for r in range(rows)
            for c in range(cols)
        ],
        dtype=f64,
    )
    half = 3 * d // 2

    def rotate(u: Tensor) -> Tensor:  # [N, H, hd]
        a, b, rest = u[..., :half], u[..., half : 2 * half], u[..., 2 * half :]
        c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
        return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)

    x = ln(x, _V + "pre_layrnorm")
    for i in range(v.num_layers):
        p = _VL.format(i)
        y = ln(x, p + "layer_norm1")
        q, k, val = (
            y @ w(p + f"self_attn.{n}.weight").T + w(p + f"self_attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")
        )
        q, k, val = rotate(q.view(-1, H, hd)), rotate(k.view(-1, H, hd)), val.view(-1, H, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(-1, h)
        x = x + attn @ w(p + "self_attn.out_proj.weight").T + w(p + "self_attn.out_proj.bias")
        y = act(ln(x, p + "layer_norm2") @ w(p + "mlp.fc1.weight").T + w(p + "mlp.fc1.bias"), v.hidden_act)
        x = x + y @ w(p + "mlp.fc2.weight").T + w(p + "mlp.fc2.bias")

    def mlp(u: Tensor, first: str, second: str) -> Tensor:
        u = act(u @ w(_PROJ + first + ".weight").T + w(_PROJ + first + ".bias"), "gelu")
        return u @ w(_PROJ + second + ".weight").T + w(_PROJ + second + ".bias")

    x = mlp(x, "linear_1", "linear_2").view(rows, cols, -1)
    tokens = [
        torch.cat([x[by * m + dy, bx * m + dx] for dy in range(m) for dx in range(m)])
        for by in range(rows // m)
        for bx in range(cols // m)
    ]
    return mlp(torch.stack(tokens), "merge_linear_1", "merge_linear_2").float()
