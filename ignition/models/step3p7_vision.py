"""Step 3.7's vision tower and projector (Step3p7Model's vision_model + multi_modal_projector), one program.

The `vision` program (helios.core.program.vision_signature) maps ONE view of an image (a tile or
the global view; the image profile cuts an image into views, helios runs the program per view)
to its tokens in the language model's embedding space:
    pixel_values [X, 3 * patch^2] fp32, normalized   (patch rows in (row, col, channel) order, row-major)
    pixel_positions [X, 2] int64                      ((x, y) patch coordinates of a full grid)
    -> image_features [X / 16, text hidden] fp32     (row-major over the grid downsampled 4x per side)
Inside, as transformers 5.24's Step3p7VisionModel: the patch convolution (a linear over each
patch), learned position embeddings bilinearly resized from their square grid to the view's,
a pre-LayerNorm, encoder layers (LayerNorm, MHA with biases and 2-D axial rotary over the whole
head — the first quarter of the dims by x, the second by y, repeated — layer-scaled residuals,
quick-GELU MLP), then two 3x3 stride-2 convolutions (no activation between) written as gathers
over the flat patch rows (every shape follows X, so one graph serves every view size), and the
linear projector. The image profile (tiling, resize, normalization, framing tokens, limits) is
data in the manifest (vision_profile).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models import vision_common as vc
from ignition.models.common import arange_like
from ignition.models.naming import with_biases
from ignition.models.patch_grid import raster_order

_V = "model.vision_model."
_PROJ = "model.multi_modal_projector."
LAYER = vc.EncoderLayout(_V + "layers.{}.", "self_attn.", "out_proj", ("layernorm_before", "layernorm_after"))
# transformers' in-memory layout (what Step3p7ForConditionalGeneration.state_dict() holds).
WEIGHT_MAP = {
    _V + "embeddings.patch_embedding.weight": "vision.patch_embed",
    _V + "embeddings.position_embedding.weight": "vision.pos_embed",
    **with_biases(_V, "vision.", (("pre_layernorm", "pre_norm"), ("downsampler1", "down1"), ("downsampler2", "down2"))),
    **with_biases("model.", "vision.", (("multi_modal_projector", "projection"),)),
    **LAYER.weight_map(),
    LAYER.prefix + "lambda_1": "vision.layers.{}.scale1",
    LAYER.prefix + "lambda_2": "vision.layers.{}.scale2",
}
# StepFun's own layout (what its hub checkpoints ship) -> transformers' names (native_tensors);
# the fused in_proj is split into q/k/v and q/k de-interleaved, as transformers' loader does.
HUB_PREFIXES = ("vision_model.", "vit_large_projector.")
_HUB_RENAMES = (
    (r"^vision_model\.conv1\.weight$", _V + "embeddings.patch_embedding.weight"),
    (r"^vision_model\.positional_embedding$", _V + "embeddings.position_embedding.weight"),
    (r"^vision_model\.ln_pre\.", _V + "pre_layernorm."),
    (r"^vision_model\.vit_downsampler([12])\.", _V + r"downsampler\1."),
    (r"^vit_large_projector\.", _PROJ),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.attn\.out_proj\.", _V + r"layers.\1.self_attn.out_proj."),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.ln_1\.", _V + r"layers.\1.layernorm_before."),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.ln_2\.", _V + r"layers.\1.layernorm_after."),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.mlp\.c_fc\.", _V + r"layers.\1.mlp.fc1."),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.mlp\.c_proj\.", _V + r"layers.\1.mlp.fc2."),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.ls_1\.gamma$", _V + r"layers.\1.lambda_1"),
    (r"^vision_model\.transformer\.resblocks\.(\d+)\.ls_2\.gamma$", _V + r"layers.\1.lambda_2"),
)
_HUB_IN_PROJ = re.compile(r"^vision_model\.transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$")
DOWNSAMPLE = 4  # two stride-2 convolutions: 4 x 4 patches per token


@dataclass(frozen=True, slots=True)
class VisionConfig(vc.Tower):
    layer_norm_eps: float
    rope_theta: float
    patch_size: int
    image_size: int  # the position table's square grid is image_size / patch_size per side
    projector_bias: bool

    @property
    def pooling_kernel_size(self) -> int:
        """Patches per token side (the profile's pooling_kernel_size): the downsampling."""
        return DOWNSAMPLE

    @property
    def position_side(self) -> int:
        return self.image_size // self.patch_size


def config_from_hf(hf: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Step3p7Config dict (StepFun's or transformers' spellings), as
    transformers reads it; unsupported variants raise ValueError."""
    v = hf["vision_config"]
    vc.activation(v, "hidden_act", "quick_gelu", ("quick_gelu",), "step5")
    theta = vc.axial_theta(v)
    vc.check_rgb(v)
    hidden = int(v.get("width", v.get("hidden_size", 1536)))
    heads = int(v.get("heads", v.get("num_attention_heads", 16)))
    vc.check_heads(hidden, heads)
    size, patch = int(v.get("image_size", 728)), int(v.get("patch_size", 14))
    if size % patch:
        raise ValueError(f"vision image_size {size} is not a multiple of patch_size {patch}")
    return VisionConfig(
        hidden_size=hidden,
        # transformers always recomputes it from mlp_ratio (a saved intermediate_size is overwritten)
        intermediate_size=int(hidden * float(v.get("mlp_ratio", 8960 / 1536))),
        num_layers=int(v.get("layers", v.get("num_hidden_layers", 47))),
        num_heads=heads,
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        rope_theta=theta,
        patch_size=patch,
        image_size=size,
        text_hidden_size=int(text.get("hidden_size", 4096)),
        projector_bias=bool(hf.get("projector_bias", False)),
        image_token_id=int(hf["image_token_id"]),
    )


def native_tensors(v: VisionConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's tensors with StepFun's vision layout rewritten in transformers' names (other
    tensors untouched): in_proj_{weight,bias} split into q/k/v, and q/k rows de-interleaved from
    (pair, 2) to (2, pair) per head, so rotate-half rotary reads them (transformers' PermuteForRope)."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if not name.startswith(HUB_PREFIXES):
            out[name] = tensor
            continue
        fused = _HUB_IN_PROJ.match(name)
        if fused:
            layer, kind = fused.groups()
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), vc.split_fused_qkv(tensor, v.num_heads)):
                out[f"{_V}layers.{layer}.self_attn.{part}.{kind}"] = chunk
            continue
        renamed = vc.hub_renamed(name, _HUB_RENAMES)
        if renamed is None:
            raise ValueError(f"unexpected vision tensor {name!r} in StepFun's layout")
        out[renamed] = tensor
    return out


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, ps, f = v.hidden_size, v.patch_size, v.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        _V + "embeddings.patch_embedding.weight": (h, 3, ps, ps),
        _V + "embeddings.position_embedding.weight": (v.position_side**2, h),
        _V + "pre_layernorm.weight": (h,),
        _V + "pre_layernorm.bias": (h,),
        _V + "downsampler1.weight": (2 * h, h, 3, 3),
        _V + "downsampler1.bias": (2 * h,),
        _V + "downsampler2.weight": (4 * h, 2 * h, 3, 3),
        _V + "downsampler2.bias": (4 * h,),
        _PROJ + "weight": (v.text_hidden_size, 4 * h),
    }
    if v.projector_bias:
        shapes[_PROJ + "bias"] = (v.text_hidden_size,)
    return shapes | LAYER.shapes(v.num_layers, h, f, {"lambda_1": (h,), "lambda_2": (h,)})


# Step3p7ImageProcessor's class defaults (its preprocessor_config.json may override the first six).
PROCESSOR_DEFAULTS = {
    "size": {"height": 728, "width": 728},
    "patch_size": 504,
    "max_image_size": 3024,
    "image_mean": vc.CLIP_MEAN,
    "image_std": vc.CLIP_STD,
    "rescale_factor": 1 / 255,
    "vision_patch_size": 14,
    "downsampler_stride": DOWNSAMPLE,
}
FRAMING = ("<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>")


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (global view plus sliding-window tiles, framing, limits) from the checkpoint's
    processor config; `token_id(text) -> id | None` resolves the framing tokens in its tokenizer."""
    ip = PROCESSOR_DEFAULTS | hf_processor.get("image_processor", hf_processor)
    size = ip["size"]
    image_size = int(size["height"]) if isinstance(size, dict) else int(size)
    if isinstance(size, dict) and int(size.get("width", image_size)) != image_size:
        raise ValueError(f"a non-square global view size {size} is not supported")
    tile, ps = int(ip["patch_size"]), v.patch_size
    if int(ip["vision_patch_size"]) != ps or int(ip["downsampler_stride"]) != DOWNSAMPLE:
        raise ValueError("the processor's vision_patch_size / downsampler_stride differ from the vision tower's")
    for name, side in (("size", image_size), ("patch_size", tile)):
        if side % (ps * DOWNSAMPLE) or side < 2 * ps * DOWNSAMPLE:
            raise ValueError(
                f"processor {name} {side} must be a multiple of {ps * DOWNSAMPLE} (patch x downsampling) "
                f"of at least two tokens per side"
            )
    if tile > image_size:
        raise ValueError(f"tiles ({tile}) larger than the global view ({image_size}) are not supported")
    vc.check_resample(ip.get("resample", 2), 2, "bilinear")
    vc.check_switches(ip)
    ids = vc.framing_ids(token_id, "<im_patch>", FRAMING, v)
    max_side = int(ip["max_image_size"])
    per_tile, per_view = (tile // (ps * DOWNSAMPLE)) ** 2, (image_size // (ps * DOWNSAMPLE)) ** 2
    # The per-image bound: a square max_image_side image's tiles plus the global view (longer,
    # thinner images that cut more tiles are refused against it per request).
    side_tiles = max_side // tile + (max_side % tile > 0.2 * tile)
    per_image = min(side_tiles**2 * per_tile + per_view, max(0, max_model_len - 3))
    return vc.image_profile(
        v,
        max_model_len,
        per_image=per_image,
        smallest=per_view,
        framing=2,
        rescale_factor=ip["rescale_factor"],
        normalized=vc.normalization(ip, ip["image_mean"], ip["image_std"]),
        prefix=(ids["<im_start>"],),  # the template renders one <im_patch> per image
        suffix=(ids["<im_end>"],),
        resize="global_and_tiles",
        patch_size=ps,
        pooling_kernel_size=DOWNSAMPLE,
        max_patches=(image_size // ps) ** 2,
        resample="torch_bilinear",
        image_size=image_size,
        tile_size=tile,
        max_image_side=max_side,
        tile_prefix_token_ids=(ids["<patch_start>"],),
        tile_suffix_token_ids=(ids["<patch_end>"],),
        tile_row_separator_token_ids=(ids["<patch_newline>"],),
    )


# ---------------------------------------------------------------------------- the program


def _grid(positions: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, columns) of a full row-major patch grid, as 0-dim tensors (no data-dependent shapes)."""
    return positions[:, 1].max() + 1, positions[:, 0].max() + 1


def _resized_positions(table: Tensor, positions: Tensor, side: int) -> Tensor:
    """The [side * side, h] position table bilinearly resized to the view's grid (F.interpolate,
    align_corners=False) and read at each patch: [X, h] fp32."""
    rows, cols = _grid(positions)

    def source(p: Tensor, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s = ((p.float() + 0.5) * (side / n.float()) - 0.5).clamp(min=0.0)
        i0 = s.floor().long().clamp(max=side - 1)
        return i0, (i0 + 1).clamp(max=side - 1), (s - i0.float()).clamp(0.0, 1.0)[:, None]

    x0, x1, lx = source(positions[:, 0], cols)
    y0, y1, ly = source(positions[:, 1], rows)
    t = table.float()
    top = t[y0 * side + x0] * (1 - lx) + t[y0 * side + x1] * lx
    bottom = t[y1 * side + x0] * (1 - lx) + t[y1 * side + x1] * lx
    return top * (1 - ly) + bottom * ly


def _conv3x3_s2(x: Tensor, rows: Tensor, cols: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """A 3x3, stride-2, padding-1 convolution over row-major grid rows: x [rows * cols, C] ->
    [rows/2 * cols/2, O] fp32 (even sides), as nine gathered taps and one matmul."""
    n = x.shape[0] // 4
    out_cols = torch.div(cols, 2, rounding_mode="floor")
    o = arange_like(x, n, dtype=torch.int64)
    oy, ox = torch.div(o, out_cols, rounding_mode="floor"), o % out_cols
    tap = arange_like(x, 9, dtype=torch.int64)
    iy = 2 * oy[:, None] + torch.div(tap, 3, rounding_mode="floor")[None, :] - 1  # [n, 9]
    ix = 2 * ox[:, None] + (tap % 3)[None, :] - 1
    valid = (iy >= 0) & (iy < rows) & (ix >= 0) & (ix < cols)
    index = torch.where(valid, iy * cols + ix, 0)
    taps = x[index] * valid[..., None].to(x.dtype)  # [n, 9, C]
    w = weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)  # [O, (dy, dx, C)]
    return F.linear(taps.reshape(n, -1).to(weight.dtype), w).float() + bias.float()


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, eps = v.hidden_size, v.layer_norm_eps
        patch = weights["vision.patch_embed"]  # [h, 3, p, p] -> a linear over (row, col, channel) patch rows
        lin = vc.Linears(weights, patch.dtype)
        x = F.linear(pixel_values.to(lin.dtype), patch.permute(0, 2, 3, 1).reshape(h, -1)).float()
        x = x + _resized_positions(weights["vision.pos_embed"], pixel_positions, v.position_side)
        x = lin.norm("vision.pre_norm", x, eps)
        # The first quarter of the head's dims by x, the second by y, repeated.
        cos_sin = vc.axial_cos_sin(pixel_positions[:, 0], pixel_positions[:, 1], v.head_dim, v.rope_theta)
        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            x = vc.encoder_layer(lin, p, x, v.num_heads, cos_sin, "quick_gelu", eps, layer_scale=True)
        rows, cols = _grid(pixel_positions)
        x = _conv3x3_s2(x, rows, cols, weights["vision.down1"], weights["vision.down1.bias"])
        half_rows, half_cols = torch.div(rows, 2, rounding_mode="floor"), torch.div(cols, 2, rounding_mode="floor")
        x = _conv3x3_s2(x, half_rows, half_cols, weights["vision.down2"], weights["vision.down2.bias"])
        out = F.linear(x.to(lin.dtype), weights["vision.projection"]).float()
        if "vision.projection.bias" in weights:
            out = out + weights["vision.projection.bias"].float()
        return (out,)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """An 8 x 12 patch grid (2 x 3 tokens): rows differ from columns, so neither specializes."""
    rows, cols = 2 * DOWNSAMPLE, 3 * DOWNSAMPLE
    pixels = torch.randn(rows * cols, 3 * v.patch_size**2, generator=torch.Generator().manual_seed(0))
    return pixels, raster_order(rows, cols)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 tower + projector over Hugging Face names, written apart from the program: the
    patches reassembled into an image for real convolutions, F.interpolate for the position grid,
    an explicit attention matrix. -> [X / 16, text hidden] fp32."""
    f64 = torch.float64
    w = lambda name: hf[name].to(f64)  # noqa: E731
    ps, h, H = v.patch_size, v.hidden_size, v.num_heads
    hd = h // H
    rows, cols = vc.reference_grid(positions)
    image = torch.zeros(rows * ps, cols * ps, 3, dtype=f64)
    for (x, y), patch in zip(positions.tolist(), pixels.to(f64)):
        image[y * ps : (y + 1) * ps, x * ps : (x + 1) * ps] = patch.view(ps, ps, 3)
    t = F.conv2d(image.permute(2, 0, 1)[None], w(_V + "embeddings.patch_embedding.weight"), stride=ps)  # [1, h, r, c]
    side = v.position_side
    table = w(_V + "embeddings.position_embedding.weight").T.reshape(1, h, side, side)
    t = t + F.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=False)
    x = t.flatten(2)[0].T  # [r * c, h] row-major

    def ln(t: Tensor, name: str) -> Tensor:
        return F.layer_norm(t, (h,), w(name + ".weight"), w(name + ".bias"), v.layer_norm_eps)

    x = ln(x, _V + "pre_layernorm")
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    inv = torch.tensor([v.rope_theta ** (-j / (hd // 2)) for j in range(0, hd // 2, 2)], dtype=f64)
    quarter = torch.cat([gx.reshape(-1, 1).to(f64) * inv, gy.reshape(-1, 1).to(f64) * inv], dim=-1)  # [N, hd / 2]
    rotate = lambda t: vc.reference_rotate(t, quarter)  # noqa: E731  (pairs (j, j + hd/2) turn by quarter[:, j])
    scales = ("lambda_1", "lambda_2")
    for i in range(v.num_layers):
        x = vc.reference_layer(w, LAYER, i, x, H, rotate, "quick_gelu", v.layer_norm_eps, scales=scales)
    grid = x.T.reshape(1, h, rows, cols)
    grid = F.conv2d(grid, w(_V + "downsampler1.weight"), w(_V + "downsampler1.bias"), stride=2, padding=1)
    grid = F.conv2d(grid, w(_V + "downsampler2.weight"), w(_V + "downsampler2.bias"), stride=2, padding=1)
    out = grid.flatten(2)[0].T @ w(_PROJ + "weight").T
    if _PROJ + "bias" in hf:
        out = out + w(_PROJ + "bias")
    return out.float()
