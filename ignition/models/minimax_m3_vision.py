"""MiniMax M3's vision tower and projector (MiniMaxM3VLModel's vision_tower + multi_modal_projector), one program.

The `vision` program maps one image's patch clips in merge-block order (vision_common's ClipTower
layout, as transformers' MiniMaxM3VLImageProcessor lays them out) to one token per m x m block. Inside, as transformers 5.24's MiniMaxM3VLVisionModel
and MiniMaxM3VLMultiModalProjector: the Conv3d patch embedding (a linear over each patch row, no
bias), a pre-LayerNorm, encoder layers (LayerNorm, MHA with biases and a partial 3-D rotary over the
(frame, y, x) axes, LayerNorm, GELU MLP), no final norm; then the projector: a GELU MLP per patch
into the text width, each block's m^2 rows concatenated, and a second GELU MLP to one token. The
temporal position of a still image is 0, so (x, y) positions are all the tower needs. The image
profile (smart_resize bounds, normalization, framing, limits) is data in the manifest (profile()).
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

_V = "model.vision_tower."
_PROJ = "model.multi_modal_projector."
LAYER = vc.EncoderLayout(_V + "layers.{}.", "self_attn.", "out_proj", ("layer_norm1", "layer_norm2"))
# transformers' in-memory layout (what MiniMaxM3SparseForConditionalGeneration.state_dict() holds).
WEIGHT_MAP = {
    _V + "embeddings.proj.weight": "vision.patch_embed",
    **with_biases(_V, "vision.", (("pre_layrnorm", "pre_norm"),)),
    **with_biases(_PROJ, "vision.", (("linear_1", "proj1"), ("linear_2", "proj2"))),
    **with_biases(_PROJ, "vision.", (("merge_linear_1", "merge1"), ("merge_linear_2", "merge2"))),
    **LAYER.weight_map(),
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
class VisionConfig(vc.ClipTower):
    layer_norm_eps: float
    rope_theta: float
    hidden_act: str  # one of ACTIVATIONS (the tower's MLP; the projector's is always exact GELU)
    projector_hidden_size: int

    @property
    def axis_dim(self) -> int:
        """Rotated channels per axis (frame, y, x): 2 * ((head_dim // 3) // 2); the rotary covers
        3 * axis_dim channels, the rest pass through."""
        return 2 * ((self.head_dim // 3) // 2)


def image_token_id(top: dict[str, Any]) -> int:
    """The image placeholder id of a MiniMaxM3VLConfig dict (either spelling, else the class default)."""
    return int(top.get("image_token_id", top.get("image_token_index", DEFAULT_IMAGE_TOKEN_ID)))


# The fields read as they stand in vision_config (with MiniMaxM3VisionConfig's defaults).
_FIELDS = Fields(
    VisionConfig,
    intermediate_size=5120,
    num_layers=Key("num_hidden_layers", 32),
    layer_norm_eps=1e-5,
    patch_size=14,
    temporal_patch_size=2,
    merge_size=Key("spatial_merge_size", 2),
)


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a MiniMaxM3VLConfig dict, as transformers reads it; unsupported variants
    raise ValueError."""
    v = top["vision_config"]
    act = vc.activation(v, "hidden_act", "gelu", ACTIVATIONS, "minimax_m3")
    theta = vc.axial_theta(v)
    vc.check_rgb(v)
    hidden, heads = int(v.get("hidden_size", 1280)), int(v.get("num_attention_heads", 16))
    if hidden % heads or (hidden // heads) // 3 < 2:
        raise ValueError(f"vision hidden_size {hidden} over {heads} heads leaves no rotary channels per axis")
    text_hidden = int(text.get("hidden_size", 6144))
    return VisionConfig(
        **_FIELDS.read(v),
        hidden_size=hidden,
        num_heads=heads,
        rope_theta=theta,
        hidden_act=act,
        projector_hidden_size=int(top.get("projector_hidden_size", 6144)),
        text_hidden_size=text_hidden,
        image_token_id=image_token_id(top),
    )


def native_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's tensors with MiniMax's vision layout renamed to transformers' (others untouched)."""
    return {vc.hub_renamed(name, _HUB_RENAMES) or name: tensor for name, tensor in tensors.items()}


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
    return shapes | LAYER.shapes(v.num_layers, h, f)


# MiniMaxM3VLImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = vc.processor_defaults(vc.CLIP_MEAN, vc.CLIP_STD, min_pixels=4 * 28 * 28, max_pixels=451584)
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
    ip, settings = vc.processor_settings(hf_processor, PROCESSOR_DEFAULTS)
    vc.check_patching(settings, v, ("patch_size", "temporal_patch_size", "merge_size"))
    vc.check_resample(settings["resample"], 3, "bicubic")
    vc.check_switches(ip)
    ps, m = int(settings["patch_size"]), int(settings["merge_size"])
    low, high = _pixel_bounds(ip)
    factor = ps * m
    if not 0 < low <= high or high < 2 * factor**2:
        raise ValueError(f"min_pixels {low} / max_pixels {high} must bound at least two {factor}x{factor} tokens")
    ids = vc.framing_ids(token_id, IMAGE_TOKEN, (START_TOKEN, END_TOKEN), v)
    # smart_resize keeps an image's area within max_pixels except at extreme aspect ratios (a side
    # floored to one factor); those cost more and are refused against this per request.
    per_image = max(0, min(high // factor**2, max_model_len - 1 - 2))
    return vc.image_profile(
        v,
        max_model_len,
        per_image=per_image,
        smallest=max(2, low // factor**2),
        framing=2,  # start + end of image around each image's tokens
        rescale_factor=settings["rescale_factor"],
        normalized=vc.normalization(ip, settings["image_mean"], settings["image_std"]),
        prefix=(ids[START_TOKEN],),  # the template renders one ]<]image[>[ per image
        suffix=(ids[END_TOKEN],),
        resize="smart_resize",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=per_image * m * m,
        resample="torch_bicubic",
        min_pixels=low,
        max_pixels=high,
        temporal_patch_size=v.temporal_patch_size,
    )


# ---------------------------------------------------------------------------- the program


def _cos_sin(positions: Tensor, v: VisionConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, 3 * axis_dim]: angles by (frame 0, y, x) per axis_dim / 2 frequencies, the set
    repeated for rotate-half, as MiniMaxM3VLVisionRotaryEmbedding."""
    inv = vc.inverse_frequencies(v.axis_dim, v.rope_theta, positions)
    y = positions[:, 1].float()[:, None] * inv
    return vc.rope_tables(torch.cat([torch.zeros_like(y), y, positions[:, 0].float()[:, None] * inv], dim=-1))


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        patch = weights["vision.patch_embed"]  # [h, 3, t, p, p]: a linear over (channel, frame, row, col) rows
        lin = vc.Linears(weights, patch.dtype)
        x = F.linear(pixel_values.to(patch.dtype), patch.reshape(v.hidden_size, -1)).float()
        x = lin.norm("vision.pre_norm", x, v.layer_norm_eps)
        cos_sin = _cos_sin(pixel_positions, v)
        for i in range(v.num_layers):
            x = vc.encoder_layer(lin, f"vision.layers.{i}.", x, v.num_heads, cos_sin, v.hidden_act, v.layer_norm_eps)
        x = lin("vision.proj2", F.gelu(lin("vision.proj1", x)))  # [X, text hidden]
        x = vc.merge_blocks(x, v.merge_size).flatten(1)  # each merge block's m^2 rows side by side
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
    ps, t, h = v.patch_size, v.temporal_patch_size, v.hidden_size
    rows, cols = vc.reference_grid(positions)
    clip = vc.reference_clip(pixels, positions, ps, t)
    grid = F.conv3d(clip[None], w(_V + "embeddings.proj.weight"), stride=(t, ps, ps))[0, :, 0]  # [h, rows, cols]
    x = grid.flatten(1).T  # [rows * cols, h] row-major
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
    x = F.layer_norm(x, (h,), w(_V + "pre_layrnorm.weight"), w(_V + "pre_layrnorm.bias"), v.layer_norm_eps)
    rotate = lambda u: vc.reference_rotate(u, angle)  # noqa: E731
    for i in range(v.num_layers):
        x = vc.reference_layer(w, LAYER, i, x, v.num_heads, rotate, v.hidden_act, v.layer_norm_eps)

    def mlp(u: Tensor, first: str, second: str) -> Tensor:
        u = vc.reference_activation(u @ w(_PROJ + first + ".weight").T + w(_PROJ + first + ".bias"), "gelu")
        return u @ w(_PROJ + second + ".weight").T + w(_PROJ + second + ".bias")

    x = mlp(x, "linear_1", "linear_2").view(rows, cols, -1)
    return mlp(vc.reference_blocks(x, v.merge_size), "merge_linear_1", "merge_linear_2").float()
