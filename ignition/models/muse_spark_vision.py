"""Muse Spark's vision tower, adapter and projection (MuseSparkModel.get_image_features), one program.

The `vision` program maps one image's patch clips (t = patch_temporal frames) in merge-block order
(vision_common's ClipTower layout, helios' smart_resize one) to one token per m x m block, the order
transformers' pixel_shuffle gathers them in. transformers'
MuseGlimmerImageProcessor lays patches out row-major with each patch's pixels in (frame, channel,
row, col) order instead; the program reads the patch embedding's columns in helios' order, and
attention does not depend on the row order, so the two layouts give the same features.

Inside, as transformers 5.24's MuseSparkVisionModel + MuseSparkVisionAdapter: a linear patch
embedding (no bias) plus the learned pos_emb_height x pos_emb_width position table resampled to the
image's grid (bilinear, align_corners=False, zero padding, read at transformers' transposed
coordinates: the row-major patch index i = y * W + x of an H x W grid samples the table at row
(i // H) of W and column (i % H) of H, as the reference's meshgrid(..., indexing="xy") feeds
grid_sample); a pre-LayerNorm; encoder layers (LayerNorm, MHA with biases and a 2-D axial rotary
over (x + 1, y + 1), head_dim / 4 frequencies each, repeated for rotate-half; LayerNorm, GELU MLP),
attention within pos_emb_height x pos_emb_height patch windows on "window_attention" layers and over
the whole image on "full_attention" ones; a post-LayerNorm; each merge block's m^2 rows interleaved
channel by channel (pixel_shuffle); the adapter (fc1, GELU, fc2, GELU, no biases), the projection
into the text width and a weightless RMSNorm (perception_emb_norm, the text model's rms_norm_eps).
The image profile (the token-capped aspect grid, normalization, framing, limits) is data in the
manifest (profile()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models import vision_common as vc
from ignition.models.common import arange_like
from ignition.models.hf_config import Fields, Key
from ignition.models.naming import with_biases
from ignition.models.patch_grid import still_clip_example

_V = "model.vision_tower."
_A = "model.vision_adapter."
LAYER = vc.EncoderLayout(_V + "layers.{}.", "attn.", "proj", ("norm1", "norm2"))
WEIGHT_MAP = {
    _V + "patch_embedder.patch_embedding.weight": "vision.patch_embed",
    _V + "patch_embedder.position_embedding_table.weight": "vision.pos_table",
    **with_biases(_V, "vision.", (("ln_pre", "pre_norm"), ("ln_post", "post_norm"))),
    _A + "fc1.weight": "vision.adapter1",
    _A + "fc2.weight": "vision.adapter2",
    "model.vision_projection.weight": "vision.projection",
    **LAYER.weight_map(),
}
VISION_PREFIXES = (_V, _A, "model.vision_projection.")
WINDOW, FULL = "window_attention", "full_attention"
LAYER_NORM_EPS = 1e-5  # MuseSparkVisionEncoderLayer's norm1 / norm2 (fixed; ln_pre / ln_post read layer_norm_eps)
DEFAULT_IMAGE_TOKEN_ID = 200092  # MuseSparkConfig.image_token_id
IMAGE_TOKEN, START_TOKEN, END_TOKEN = "<|patch|>", "<|image_start|>", "<|image_end|>"  # MuseSparkProcessor's


@dataclass(frozen=True, slots=True)
class VisionConfig(vc.ClipTower):
    layer_norm_eps: float  # ln_pre / ln_post
    rope_theta: float
    pos_side: int  # pos_emb_height == pos_emb_width: the position table's side and the window side in patches
    layer_windows: tuple[bool, ...]  # per layer: window attention (else the whole image)
    projector_hidden_size: int
    text_rms_norm_eps: float  # perception_emb_norm's eps


def image_token_id(top: dict[str, Any]) -> int:
    return int(top.get("image_token_id") if top.get("image_token_id") is not None else DEFAULT_IMAGE_TOKEN_ID)


# The fields read as they stand in vision_config (with MuseSparkVisionConfig's defaults).
_FIELDS = Fields(
    VisionConfig,
    intermediate_size=8960,
    layer_norm_eps=1e-5,
    patch_size=14,
    temporal_patch_size=Key("patch_temporal", 2),
)


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a MuseSparkConfig dict (MuseSparkVisionConfig's defaults where absent);
    unsupported variants raise ValueError."""
    v = top.get("vision_config") or {}
    vc.activation(v, "hidden_act", "gelu", ("gelu",), "muse_spark")
    if top.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"projector_hidden_act {top.get('projector_hidden_act')!r} is not supported (gelu is)")
    rope = vc.axial_rope(v)
    side, width = int(v.get("pos_emb_height", 32)), int(v.get("pos_emb_width", 32))
    if side != width:
        raise ValueError(
            f"vision pos_emb_height {side} != pos_emb_width {width} is not supported (transformers "
            "assumes a square table)"
        )
    hidden, heads = int(v.get("hidden_size", 1536)), int(v.get("num_attention_heads", 16))
    vc.check_heads(hidden, heads)
    layers = int(v.get("num_hidden_layers", 50))
    types = v.get("layer_types") or [FULL if (i + 1) % 4 == 0 or i == layers - 1 else WINDOW for i in range(layers)]
    if len(types) != layers or set(types) - {WINDOW, FULL}:
        raise ValueError(f"vision layer_types must name {layers} layers as {WINDOW} or {FULL}, got {types!r}")
    merge = int(v.get("merge_size", 2))
    out = int(top.get("out_hidden_size", 6144))
    if out != hidden * merge**2:
        raise ValueError(f"out_hidden_size {out} is not the vision hidden_size {hidden} times merge_size^2 ({merge}^2)")
    return VisionConfig(
        **_FIELDS.read(v),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        merge_size=merge,
        pos_side=side,
        layer_windows=tuple(t == WINDOW for t in types),
        projector_hidden_size=int(top.get("projector_hidden_size", 4096)),
        text_hidden_size=int(text["hidden_size"]),
        text_rms_norm_eps=float(text["rms_norm_eps"]),
        image_token_id=image_token_id(top),
    )


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, f, p = v.hidden_size, v.intermediate_size, v.projector_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        _V + "patch_embedder.patch_embedding.weight": (h, v.patch_dim),
        _V + "patch_embedder.position_embedding_table.weight": (v.pos_side**2, h),
        _V + "ln_pre.weight": (h,),
        _V + "ln_pre.bias": (h,),
        _V + "ln_post.weight": (h,),
        _V + "ln_post.bias": (h,),
        _A + "fc1.weight": (p, h * v.merge_size**2),
        _A + "fc2.weight": (p, p),
        "model.vision_projection.weight": (v.text_hidden_size, p),
    }
    return shapes | LAYER.shapes(v.num_layers, h, f)


# MuseGlimmerImageProcessor's class defaults (its preprocessor_config.json may override them).
LANCZOS = 1  # PILImageResampling.LANCZOS
PROCESSOR_DEFAULTS = vc.processor_defaults(vc.STANDARD_MEAN, vc.STANDARD_STD, max_image_tokens=4096, resample=LANCZOS)


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (aspect_grid under max_image_tokens, normalization, framing, limits) from the
    checkpoint's processor config; `token_id(text) -> id | None` resolves the framing tokens."""
    ip, settings = vc.processor_settings(hf_processor, PROCESSOR_DEFAULTS)
    vc.check_patching(settings, v, ("patch_size", "temporal_patch_size", "merge_size"))
    vc.check_resample(settings["resample"], LANCZOS, "LANCZOS")
    vc.check_switches(ip)
    if ip.get("size"):
        raise ValueError(f"size {ip['size']!r} is not read by MuseGlimmerImageProcessor's resize (max_image_tokens is)")
    cap = int(settings["max_image_tokens"])
    if cap < 2:
        raise ValueError(f"max_image_tokens {cap} must allow at least two tokens")
    ids = vc.framing_ids(token_id, IMAGE_TOKEN, (START_TOKEN, END_TOKEN), v)
    m = v.merge_size
    return vc.image_profile(
        v,
        max_model_len,
        per_image=max(0, min(cap, max_model_len - 1 - 2)),
        # The smallest admitted image is two tokens (one-token grids are refused per request: the vision
        # program's patch count starts at two tokens' worth).
        smallest=2,
        framing=2,  # <|image_start|> + <|image_end|> around each image's tokens
        rescale_factor=settings["rescale_factor"],
        normalized=vc.normalization(ip, settings["image_mean"], settings["image_std"]),
        prefix=(ids[START_TOKEN],),  # the template renders one <|patch|> per image
        suffix=(ids[END_TOKEN],),
        resize="aspect_grid",
        patch_size=v.patch_size,
        pooling_kernel_size=m,
        max_patches=cap * m * m,  # the token cap, in patches (aspect_grid reads max_patches // k^2)
        resample="lanczos",
        temporal_patch_size=v.temporal_patch_size,
    )


# ---------------------------------------------------------------------------- the program


def _pos_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear taps [N, 2] into a `side`-long table axis and their weights (align_corners=False, out of
    range taps weigh 0), for `index` on an axis of `size` positions; fp32 as transformers computes them."""
    src = (index.float() + 0.5) * side / size.float() - 0.5
    floor = torch.floor(src)
    raw = floor.long()[:, None] + arange_like(index, 2, dtype=torch.int64)[None, :]
    weights = (1 - (src[:, None] - raw.float()).abs()).clamp(min=0) * ((raw >= 0) & (raw <= side - 1))
    return raw.clamp(0, side - 1), weights


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, side, eps = v.hidden_size, v.pos_side, v.layer_norm_eps
        patch = weights["vision.patch_embed"]  # [h, (frame, channel, row, col)]
        lin = vc.Linears(weights, patch.dtype)
        t = v.temporal_patch_size
        patch = patch.reshape(h, t, 3, v.patch_size**2).transpose(1, 2).reshape(h, -1)  # (channel, frame, ...)
        x = F.linear(pixel_values.to(lin.dtype), patch).float()
        xs, ys = pixel_positions[:, 0], pixel_positions[:, 1]
        cols, rows = xs.max() + 1, ys.max() + 1
        flat = ys * cols + xs  # the row-major index transformers' interpolation decodes at (i // H, i % H)
        r_taps, r_w = _pos_taps(flat // rows, cols, side)
        c_taps, c_w = _pos_taps(flat % rows, rows, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
        tap_w = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4)
        table = weights["vision.pos_table"].float()
        x = lin.norm("vision.pre_norm", x + (table[index] * tap_w[:, :, None]).sum(1), eps)
        # Axial rotary: head_dim / 4 frequencies over x + 1, then over y + 1, the set repeated for rotate-half.
        cos_sin = vc.axial_cos_sin(xs + 1, ys + 1, v.head_dim, v.rope_theta)
        window = (ys // side) * (cols // side + 1) + xs // side
        same_window = window[:, None] == window[None, :]
        for i in range(v.num_layers):
            mask = same_window if v.layer_windows[i] else None
            x = vc.encoder_layer(lin, f"vision.layers.{i}.", x, v.num_heads, cos_sin, "gelu", LAYER_NORM_EPS, mask)
        x = lin.norm("vision.post_norm", x, eps)
        # pixel_shuffle: each merge block's m^2 rows, interleaved channel by channel.
        x = vc.merge_blocks(x, v.merge_size).transpose(1, 2).flatten(1)
        x = F.gelu(lin("vision.adapter2", F.gelu(lin("vision.adapter1", x))))
        x = lin("vision.projection", x)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + v.text_rms_norm_eps),)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """A 4 x 6 patch grid (2 x 3 tokens at m = 2) of still frames (patch_grid.still_clip_example)."""
    return still_clip_example(v.merge_size, v.patch_size, v.temporal_patch_size)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 tower + adapter + projection over Hugging Face names, written apart from the program:
    the patches put back on their grid (raster order) with their (frame, channel) pixels as
    transformers' processor lays them out, the position table resampled by F.grid_sample at the
    reference's transposed meshgrid, rotary angles pair by pair, explicit attention matrices per
    window, and the merge blocks read off the grid by position. -> [X / m^2, text hidden] fp32, one
    row per merge block, blocks row-major."""
    f64 = torch.float64
    w = lambda name: hf[name].to(f64)  # noqa: E731
    ps, t, h, H, m, side = v.patch_size, v.temporal_patch_size, v.hidden_size, v.num_heads, v.merge_size, v.pos_side
    hd = h // H
    rows, cols = vc.reference_grid(positions)
    raster = torch.zeros(rows * cols, t * 3 * ps * ps, dtype=f64)
    for (x, y), patch in zip(positions.tolist(), pixels.to(f64)):  # (channel, frame, ...) -> (frame, channel, ...)
        raster[y * cols + x] = patch.view(3, t, ps * ps).transpose(0, 1).reshape(-1)
    x = raster @ w(_V + "patch_embedder.patch_embedding.weight").T
    # grid_sample over the table as an image [h, side, side]: output row a of W, column b of H.
    table = w(_V + "patch_embedder.position_embedding_table.weight").T.reshape(1, h, side, side)
    gy = (2 * torch.arange(cols, dtype=f64) + 1) / cols - 1  # W rows (the "h" axis fed the width)
    gx = (2 * torch.arange(rows, dtype=f64) + 1) / rows - 1
    grid = torch.stack(torch.meshgrid(gy, gx, indexing="ij")[::-1], dim=-1)[None]  # [1, W, H, (x, y)]
    pos = F.grid_sample(table, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]  # [h, W, H]
    x = x + pos.reshape(h, -1).T

    def ln(u: Tensor, name: str, eps: float) -> Tensor:
        return F.layer_norm(u, (h,), w(name + ".weight"), w(name + ".bias"), eps)

    f = hd // 4
    freqs = [v.rope_theta ** (-2 * j / (hd // 2)) for j in range(f)]
    angle = torch.tensor(
        [[(c + 1) * fr for fr in freqs] + [(r + 1) * fr for fr in freqs] for r in range(rows) for c in range(cols)],
        dtype=f64,
    )
    windows: list[list[int]] = []
    for wy in range(0, rows, side):
        for wx in range(0, cols, side):
            windows.append(
                [r * cols + c for r in range(wy, min(rows, wy + side)) for c in range(wx, min(cols, wx + side))]
            )

    def attend(members: list[list[int]]):
        def each(q: Tensor, k: Tensor, val: Tensor) -> Tensor:  # explicit attention matrices per window
            attn = torch.zeros_like(val)
            for idx in map(torch.tensor, members):
                attn[idx] = vc.reference_attention(q[idx], k[idx], val[idx])
            return attn

        return each

    rotate = lambda u: vc.reference_rotate(u, angle)  # noqa: E731
    x = ln(x, _V + "ln_pre", v.layer_norm_eps)
    for i in range(v.num_layers):
        members = windows if v.layer_windows[i] else [list(range(rows * cols))]
        x = vc.reference_layer(w, LAYER, i, x, H, rotate, "gelu", LAYER_NORM_EPS, attend(members))
    x = ln(x, _V + "ln_post", v.layer_norm_eps).view(rows, cols, h)
    u = vc.reference_blocks(x, m, interleave=True) @ w(_A + "fc1.weight").T
    u = vc.reference_activation(vc.reference_activation(u, "gelu") @ w(_A + "fc2.weight").T, "gelu")
    u = u @ w("model.vision_projection.weight").T
    return (u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + v.text_rms_norm_eps)).float()
