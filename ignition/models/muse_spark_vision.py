"""Muse Spark's vision tower, adapter and projection (MuseSparkModel.get_image_features), one program.

The `vision` program (helios.core.program.vision_signature) maps one image to its tokens in the
language model's embedding space:
    pixel_values [X, 3 * t * patch^2] fp32, normalized   (each patch's pixels in (channel, frame, row,
                                                           col) order, the still image repeated over
                                                           t = patch_temporal frames)
    pixel_positions [X, 2] int64                           ((x, y) patch coordinates)
    -> image_features [X / m^2, text hidden] fp32          (one row per m x m merge block)
Patches come in merge-block order (the m x m blocks row-major, the patches of a block row-major
inside it: helios' smart_resize layout), so block b's patches are rows m^2 b .. m^2 b + m^2 - 1 and
its token is row b, the order transformers' pixel_shuffle gathers them in. transformers'
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

import math
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
_A = "model.vision_adapter."
WEIGHT_MAP = {
    _V + "patch_embedder.patch_embedding.weight": "vision.patch_embed",
    _V + "patch_embedder.position_embedding_table.weight": "vision.pos_table",
    _V + "ln_pre.weight": "vision.pre_norm",
    _V + "ln_pre.bias": "vision.pre_norm.bias",
    _V + "ln_post.weight": "vision.post_norm",
    _V + "ln_post.bias": "vision.post_norm.bias",
    _A + "fc1.weight": "vision.adapter1",
    _A + "fc2.weight": "vision.adapter2",
    "model.vision_projection.weight": "vision.projection",
    **with_biases(
        _VL,
        "vision.layers.{}.",
        (
            ("attn.q_proj", "wq"),
            ("attn.k_proj", "wk"),
            ("attn.v_proj", "wv"),
            ("attn.proj", "wo"),
            ("mlp.fc1", "fc1"),
            ("mlp.fc2", "fc2"),
            ("norm1", "norm1"),
            ("norm2", "norm2"),
        ),
    ),
}
VISION_PREFIXES = (_V, _A, "model.vision_projection.")
WINDOW, FULL = "window_attention", "full_attention"
LAYER_NORM_EPS = 1e-5  # MuseSparkVisionEncoderLayer's norm1 / norm2 (fixed; ln_pre / ln_post read layer_norm_eps)
DEFAULT_IMAGE_TOKEN_ID = 200092  # MuseSparkConfig.image_token_id
IMAGE_TOKEN, START_TOKEN, END_TOKEN = "<|patch|>", "<|image_start|>", "<|image_end|>"  # MuseSparkProcessor's


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float  # ln_pre / ln_post
    rope_theta: float
    patch_size: int
    temporal_patch_size: int  # frames per patch (patch_temporal); a still image is repeated over them
    merge_size: int  # m: m x m patches merge into one token
    pos_side: int  # pos_emb_height == pos_emb_width: the position table's side and the window side in patches
    layer_windows: tuple[bool, ...]  # per layer: window attention (else the whole image)
    projector_hidden_size: int
    text_hidden_size: int
    text_rms_norm_eps: float  # perception_emb_norm's eps
    image_token_id: int

    @property
    def pooling_kernel_size(self) -> int:
        """Patches per token side (the profile's pooling_kernel_size): the spatial merge."""
        return self.merge_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


def image_token_id(top: dict[str, Any]) -> int:
    return int(top.get("image_token_id") if top.get("image_token_id") is not None else DEFAULT_IMAGE_TOKEN_ID)


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a MuseSparkConfig dict (MuseSparkVisionConfig's defaults where absent);
    unsupported variants raise ValueError."""
    v = top.get("vision_config") or {}
    if v.get("hidden_act", "gelu") != "gelu":
        raise ValueError(
            f"vision hidden_act {v.get('hidden_act')!r} is not supported by the muse_spark family (gelu is)"
        )
    if top.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"projector_hidden_act {top.get('projector_hidden_act')!r} is not supported (gelu is)")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported (axial is)")
    side, width = int(v.get("pos_emb_height", 32)), int(v.get("pos_emb_width", 32))
    if side != width:
        raise ValueError(
            f"vision pos_emb_height {side} != pos_emb_width {width} is not supported (transformers "
            "assumes a square table)"
        )
    hidden, heads = int(v.get("hidden_size", 1536)), int(v.get("num_attention_heads", 16))
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"vision hidden_size {hidden} over {heads} heads must give a head_dim divisible by 4")
    layers = int(v.get("num_hidden_layers", 50))
    types = v.get("layer_types") or [FULL if (i + 1) % 4 == 0 or i == layers - 1 else WINDOW for i in range(layers)]
    if len(types) != layers or set(types) - {WINDOW, FULL}:
        raise ValueError(f"vision layer_types must name {layers} layers as {WINDOW} or {FULL}, got {types!r}")
    merge = int(v.get("merge_size", 2))
    out = int(top.get("out_hidden_size", 6144))
    if out != hidden * merge**2:
        raise ValueError(f"out_hidden_size {out} is not the vision hidden_size {hidden} times merge_size^2 ({merge}^2)")
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 8960)),
        num_layers=layers,
        num_heads=heads,
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("patch_temporal", 2)),
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
    for i in range(v.num_layers):
        q = _VL.format(i)
        shapes |= biased_shapes(q, ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj"), h, h)
        shapes |= biased_shapes(q, ("mlp.fc1",), f, h) | biased_shapes(q, ("mlp.fc2",), h, f)
        shapes |= biased_shapes(q, ("norm1", "norm2"), h)
    return shapes


# MuseGlimmerImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "max_image_tokens": 4096,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
    "resample": 1,
}
LANCZOS = 1  # PILImageResampling.LANCZOS


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (aspect_grid under max_image_tokens, normalization, framing, limits) from the
    checkpoint's processor config; `token_id(text) -> id | None` resolves the framing tokens."""
    ip = hf_processor.get("image_processor", hf_processor)
    settings = {k: ip.get(k) if ip.get(k) is not None else d for k, d in PROCESSOR_DEFAULTS.items()}
    ps, t, m = int(settings["patch_size"]), int(settings["temporal_patch_size"]), int(settings["merge_size"])
    if (ps, t, m) != (v.patch_size, v.temporal_patch_size, v.merge_size):
        raise ValueError(
            f"the processor's patch_size / temporal_patch_size / merge_size ({ps}, {t}, {m}) differ "
            f"from the vision tower's ({v.patch_size}, {v.temporal_patch_size}, {v.merge_size})"
        )
    if int(settings["resample"]) != LANCZOS:
        raise ValueError(f"resample {settings['resample']} is not supported (LANCZOS, 1, is)")
    if ip.get("do_rescale") is False or ip.get("do_convert_rgb") is False or ip.get("do_resize") is False:
        raise ValueError("do_rescale, do_resize and do_convert_rgb must stay on")
    if ip.get("size"):
        raise ValueError(f"size {ip['size']!r} is not read by MuseGlimmerImageProcessor's resize (max_image_tokens is)")
    cap = int(settings["max_image_tokens"])
    if cap < 2:
        raise ValueError(f"max_image_tokens {cap} must allow at least two tokens")
    normalize = ip.get("do_normalize", True)
    ids = {text: token_id(text) for text in (IMAGE_TOKEN, START_TOKEN, END_TOKEN)}
    missing = [text for text, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the image framing tokens {missing}")
    if ids[IMAGE_TOKEN] != v.image_token_id:
        raise ValueError(f"image_token_id {v.image_token_id} is not the tokenizer's {IMAGE_TOKEN} ({ids[IMAGE_TOKEN]})")
    framing = 2  # <|image_start|> + <|image_end|> around each image's tokens
    per_image = max(0, min(cap, max_model_len - 1 - framing))
    return mf.VisionProfile(
        resize="aspect_grid",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=cap * m * m,  # the token cap, in patches (aspect_grid reads max_patches // k^2)
        resample="lanczos",
        rescale_factor=float(settings["rescale_factor"]),
        image_mean=tuple(float(x) for x in settings["image_mean"]) if normalize else (0.0, 0.0, 0.0),
        image_std=tuple(float(x) for x in settings["image_std"]) if normalize else (1.0, 1.0, 1.0),
        placeholder_token_id=v.image_token_id,  # the template renders one <|patch|> per image
        image_token_id=v.image_token_id,
        prefix_token_ids=(ids[START_TOKEN],),
        suffix_token_ids=(ids[END_TOKEN],),
        feature_dim=v.text_hidden_size,
        # The smallest admitted image is two tokens (one-token grids are refused per request: the vision
        # program's patch count starts at two tokens' worth).
        max_images_per_prompt=max(0, (max_model_len - 1) // (2 + framing)),
        max_image_tokens_per_prompt=max(0, max_model_len - 1 - framing),
        image_feature_window_tokens=per_image,
        max_image_tokens_per_image=per_image,
        max_image_pixels=50_000_000,
        max_image_bytes=20 << 20,
        temporal_patch_size=t,
    )


# ---------------------------------------------------------------------------- the program


def _pos_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear taps [N, 2] into a `side`-long table axis and their weights (align_corners=False, out of
    range taps weigh 0), for `index` on an axis of `size` positions; fp32 as transformers computes them."""
    src = (index.float() + 0.5) * side / size.float() - 0.5
    floor = torch.floor(src)
    raw = floor.long()[:, None] + torch.arange(2, device=index.device)[None, :]
    weights = (1 - (src[:, None] - raw.float()).abs()).clamp(min=0) * ((raw >= 0) & (raw <= side - 1))
    return raw.clamp(0, side - 1), weights


class VisionProgram(torch.nn.Module):
    """forward(weights, kv_cache, pixel_values, pixel_positions) -> (image_features,); kv_cache is unused (empty)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, H, hd, side = v.hidden_size, v.num_heads, v.head_dim, v.pos_side
        patch = weights["vision.patch_embed"]  # [h, (frame, channel, row, col)]
        wdt = patch.dtype
        t = v.temporal_patch_size
        patch = patch.reshape(h, t, 3, v.patch_size**2).transpose(1, 2).reshape(h, -1)  # (channel, frame, ...)
        x = F.linear(pixel_values.to(wdt), patch).float()
        xs, ys = pixel_positions[:, 0], pixel_positions[:, 1]
        cols, rows = xs.max() + 1, ys.max() + 1
        flat = ys * cols + xs  # the row-major index transformers' interpolation decodes at (i // H, i % H)
        r_taps, r_w = _pos_taps(flat // rows, cols, side)
        c_taps, c_w = _pos_taps(flat % rows, rows, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
        tap_w = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4)
        table = weights["vision.pos_table"].float()
        x = x + (table[index] * tap_w[:, :, None]).sum(1)
        eps = v.layer_norm_eps
        x = F.layer_norm(x, (h,), weights["vision.pre_norm"].float(), weights["vision.pre_norm.bias"].float(), eps)
        # Axial rotary: head_dim / 4 frequencies over x + 1, then over y + 1, the set repeated for rotate-half.
        inv = 1.0 / (v.rope_theta ** (torch.arange(0, hd // 2, 2, device=x.device).float() / (hd // 2)))
        ang = torch.cat([(xs + 1).float()[:, None] * inv, (ys + 1).float()[:, None] * inv], dim=-1)
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        window = (ys // side) * (cols // side + 1) + xs // side
        same_window = window[:, None] == window[None, :]

        def lin(name: str, u: Tensor) -> Tensor:
            return F.linear(u.to(wdt), weights[name], weights[name + ".bias"]).float()

        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            y = F.layer_norm(x, (h,), weights[p + "norm1"].float(), weights[p + "norm1.bias"].float(), LAYER_NORM_EPS)
            q, k, val = (lin(p + name, y).reshape(-1, H, hd) for name in ("wq", "wk", "wv"))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            mask = same_window if v.layer_windows[i] else None
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), val.transpose(0, 1), attn_mask=mask
            )
            x = x + lin(p + "wo", attn.transpose(0, 1).reshape(-1, h))
            y = F.layer_norm(x, (h,), weights[p + "norm2"].float(), weights[p + "norm2.bias"].float(), LAYER_NORM_EPS)
            x = x + lin(p + "fc2", F.gelu(lin(p + "fc1", y)))
        x = F.layer_norm(x, (h,), weights["vision.post_norm"].float(), weights["vision.post_norm.bias"].float(), eps)
        # pixel_shuffle: each merge block's m^2 consecutive rows, interleaved channel by channel; gathered
        # so every shape follows X.
        group = v.merge_size**2
        n = x.shape[0] // group
        blocks = torch.arange(n, device=x.device)[:, None] * group + torch.arange(group, device=x.device)[None, :]
        x = x[blocks].transpose(1, 2).reshape(n, h * group)
        x = F.gelu(F.linear(x.to(wdt), weights["vision.adapter1"]).float())
        x = F.gelu(F.linear(x.to(wdt), weights["vision.adapter2"]).float())
        x = F.linear(x.to(wdt), weights["vision.projection"]).float()
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
    rows, cols = int(positions[:, 1].max()) + 1, int(positions[:, 0].max()) + 1
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

    def gelu(u: Tensor) -> Tensor:
        return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))

    f = hd // 4
    freqs = [v.rope_theta ** (-2 * j / (hd // 2)) for j in range(f)]
    angle = torch.tensor(
        [[(c + 1) * fr for fr in freqs] + [(r + 1) * fr for fr in freqs] for r in range(rows) for c in range(cols)],
        dtype=f64,
    )

    def rotate(u: Tensor) -> Tensor:  # [N, H, hd]: channel pairs (j, j + hd/2) turn by angle[j]
        a, b = u[..., : hd // 2], u[..., hd // 2 :]
        c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    windows: list[list[int]] = []
    for wy in range(0, rows, side):
        for wx in range(0, cols, side):
            windows.append(
                [r * cols + c for r in range(wy, min(rows, wy + side)) for c in range(wx, min(cols, wx + side))]
            )
    everything = [list(range(rows * cols))]
    x = ln(x, _V + "ln_pre", v.layer_norm_eps)
    for i in range(v.num_layers):
        p = _VL.format(i)
        y = ln(x, p + "norm1", LAYER_NORM_EPS)
        q, k, val = (y @ w(p + f"attn.{n}.weight").T + w(p + f"attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj"))
        q, k, val = rotate(q.view(-1, H, hd)), rotate(k.view(-1, H, hd)), val.view(-1, H, hd)
        attn = torch.zeros(rows * cols, H, hd, dtype=f64)
        for members in windows if v.layer_windows[i] else everything:
            idx = torch.tensor(members)
            scores = torch.einsum("qhd,khd->hqk", q[idx], k[idx]) / math.sqrt(hd)
            attn[idx] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val[idx])
        x = x + attn.reshape(-1, h) @ w(p + "attn.proj.weight").T + w(p + "attn.proj.bias")
        y = gelu(ln(x, p + "norm2", LAYER_NORM_EPS) @ w(p + "mlp.fc1.weight").T + w(p + "mlp.fc1.bias"))
        x = x + y @ w(p + "mlp.fc2.weight").T + w(p + "mlp.fc2.bias")
    x = ln(x, _V + "ln_post", v.layer_norm_eps).view(rows, cols, h)
    tokens = [
        torch.stack([x[by * m + dy, bx * m + dx] for dy in range(m) for dx in range(m)], dim=-1).reshape(-1)
        for by in range(rows // m)
        for bx in range(cols // m)
    ]
    u = gelu(gelu(torch.stack(tokens) @ w(_A + "fc1.weight").T) @ w(_A + "fc2.weight").T)
    u = u @ w("model.vision_projection.weight").T
    return (u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + v.text_rms_norm_eps)).float()
