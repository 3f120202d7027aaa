"""Kimi K2.5's vision tower and projector (Kimi_K25Model's vision_tower + mm_projector), one program.

The `vision` program maps one image's patches (pixel_values [X, 3 * patch^2], each patch's pixels in
(channel, row, col) order) in merge-block order (vision_common's MergeTower layout; transformers'
Kimi_K25ImageProcessor lays them out row-major and its temporal_merge gathers them into this order)
to one token per m x m block. Inside, as
transformers 5.24's Kimi_K25VisionModel and Kimi_K25MultimodalProjection: the Conv2d patch embedding
(a linear over each patch row, with bias) plus the learned pos_emb_height x pos_emb_width position
table resampled bicubically (align_corners=False, border taps clamped) to the image's grid, whose
extent the program reads off the positions (max + 1: a prepared view is always a full grid); encoder
layers (LayerNorm, MHA with biases and a 2-D rotary over the whole head: head_dim / 4 frequencies,
channel pairs interleaving x then y angles, repeated for rotate-half; LayerNorm, MLP); a final
LayerNorm; then the projector: a LayerNorm per patch, each block's m^2 rows concatenated, a GELU MLP
to the text width. A still image's temporal embedding is the zero row, so (x, y) is all it needs.
The image profile (navit resize + padding, normalization, framing, limits) is data in the manifest.
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
from ignition.models.hf_config import Fields, Key
from ignition.models.naming import with_biases
from ignition.models.patch_grid import block_order

_V = "model.vision_tower."
_PROJ = "model.mm_projector."
LAYER = vc.EncoderLayout(_V + "layers.{}.", "attn.", "proj", ("norm1", "norm2"))
# transformers' in-memory layout (what Kimi_K25ForConditionalGeneration.state_dict() holds).
WEIGHT_MAP = {
    _V + "patch_embed.pos_emb.position_embeddings": "vision.pos_embed",
    **with_biases(_V, "vision.", (("patch_embed.proj", "patch_embed"), ("final_layernorm", "final_norm"))),
    **with_biases(_PROJ, "vision.", (("pre_norm", "proj_norm"), ("in_proj", "proj1"), ("out_proj", "proj2"))),
    **LAYER.weight_map(),
}
# Moonshot's own layout (what its hub checkpoints ship) -> transformers' names, as transformers'
# conversion_mapping "kimi_k25" renames them; the fused wqkv is split and permuted apart (native_tensors).
_HUB_RENAMES = (
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0\.", _V + r"layers.\1.norm1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1\.", _V + r"layers.\1.norm2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.", _V + r"layers.\1.mlp.fc1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.", _V + r"layers.\1.mlp.fc2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\.", _V + r"layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.final_layernorm\.", _V + "final_layernorm."),
    (r"^vision_tower\.patch_embed\.proj\.", _V + "patch_embed.proj."),
    (r"^vision_tower\.patch_embed\.pos_emb\.weight$", _V + "patch_embed.pos_emb.position_embeddings"),
    (r"^mm_projector\.pre_norm\.", _PROJ + "pre_norm."),
    (r"^mm_projector\.proj\.0\.", _PROJ + "in_proj."),
    (r"^mm_projector\.proj\.2\.", _PROJ + "out_proj."),
)
_HUB_QKV = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)$")
VISION_PREFIXES = (_V, _PROJ, "vision_tower.", "mm_projector.")
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu")
DEFAULT_IMAGE_TOKEN_ID = 163605  # Kimi_K25Config.image_token_id (<|media_pad|>)
LAYER_NORM_EPS = 1e-5  # the encoder's and final LayerNorms are built with it, whatever the config says


@dataclass(frozen=True, slots=True)
class VisionConfig(vc.MergeTower):
    rope_theta: float
    hidden_act: str  # one of ACTIVATIONS (the tower's MLP; the projector's is always exact GELU)
    pos_emb_side: int  # the learned position table is pos_emb_side x pos_emb_side
    projection_eps: float

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2


def image_token_id(top: dict[str, Any]) -> int:
    """transformers' image_token_id, else Moonshot's media_placeholder_token_id, else the class default."""
    return int(top.get("image_token_id", top.get("media_placeholder_token_id", DEFAULT_IMAGE_TOKEN_ID)))


# The fields read as they stand in vision_config (with Kimi_K25VisionConfig's defaults).
_FIELDS = Fields(VisionConfig, intermediate_size=4304, num_layers=Key("num_hidden_layers", 27), patch_size=14)


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Kimi_K25Config dict, as transformers reads it; unsupported variants raise ValueError."""
    v = top["vision_config"]
    act = vc.activation(v, "hidden_act", "gelu_pytorch_tanh", ACTIVATIONS, "kimi_k3")
    theta = vc.axial_theta(v)
    hidden, heads = int(v.get("hidden_size", 1152)), int(v.get("num_attention_heads", 16))
    vc.check_heads(hidden, heads)
    side = int(v.get("pos_emb_height", v.get("init_pos_emb_height", 64)))  # transformers' name, then Moonshot's
    if int(v.get("pos_emb_width", v.get("init_pos_emb_width", side))) != side:
        raise ValueError("a non-square vision position table (pos_emb_height != pos_emb_width) is not supported")
    merge = list(v.get("merge_kernel_size", (2, 2)))
    if len(merge) != 2 or merge[0] != merge[1]:
        raise ValueError(f"merge_kernel_size {merge} is not square")
    if int(top.get("projection_hidden_size") or hidden) != hidden:
        raise ValueError(
            f"projection_hidden_size {top.get('projection_hidden_size')} differs from the vision "
            f"hidden_size {hidden} (the projector's LayerNorm runs over each patch row)"
        )
    return VisionConfig(
        **_FIELDS.read(v),
        hidden_size=hidden,
        num_heads=heads,
        rope_theta=theta,
        hidden_act=act,
        pos_emb_side=side,
        merge_size=int(merge[0]),
        projection_eps=float(top.get("projection_layer_norm_eps", 1e-5)),
        text_hidden_size=int(text.get("hidden_size", 7168)),
        image_token_id=image_token_id(top),
    )


def native_tensors(tensors: dict[str, Tensor], num_heads: int) -> dict[str, Tensor]:
    """The checkpoint's tensors with Moonshot's vision layout renamed to transformers' (others untouched):
    each fused wqkv split into q, k, v, and q and k rows permuted per head from the interleaved
    (complex) rotary pairs to rotate-half's halves (transformers' PermuteForRope)."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        fused = _HUB_QKV.match(name)
        if fused:
            layer, kind = fused.groups()
            for part, t in zip(("q_proj", "k_proj", "v_proj"), vc.split_fused_qkv(tensor, num_heads)):
                out[LAYER.layer(layer) + f"attn.{part}.{kind}"] = t
            continue
        out[vc.hub_renamed(name, _HUB_RENAMES) or name] = tensor
    return out


def hf_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, f, t, s, g = v.hidden_size, v.intermediate_size, v.text_hidden_size, v.pos_emb_side, v.merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        _V + "patch_embed.proj.weight": (h, 3, v.patch_size, v.patch_size),
        _V + "patch_embed.proj.bias": (h,),
        _V + "patch_embed.pos_emb.position_embeddings": (s, s, h),
        _V + "final_layernorm.weight": (h,),
        _V + "final_layernorm.bias": (h,),
        _PROJ + "pre_norm.weight": (h,),
        _PROJ + "pre_norm.bias": (h,),
        _PROJ + "in_proj.weight": (g * h, g * h),
        _PROJ + "in_proj.bias": (g * h,),
        _PROJ + "out_proj.weight": (t, g * h),
        _PROJ + "out_proj.bias": (t,),
    }
    return shapes | LAYER.shapes(v.num_layers, h, f)


# Kimi_K25ImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = {
    "max_patches": 16384,
    "max_side": 512,
    "patch_size": 14,
    "merge_size": 2,
    "image_mean": vc.STANDARD_MEAN,
    "image_std": vc.STANDARD_STD,
    "rescale_factor": 1 / 255,
    "resample": 3,
}
# Kimi_K25Processor's placeholder and the framing Kimi K2.5's template renders around it
# (<|media_begin|>image<|media_content|><|media_pad|><|media_end|>, the pad expanded to one per token).
# Kimi K3's template renders <|kimi_image_placeholder|> per image where no image_prompts are given.
IMAGE_TOKEN, BEGIN_TOKEN, CONTENT_TOKEN = "<|media_pad|>", "<|media_begin|>", "<|media_content|>"
END_TOKEN = "<|media_end|>"
KIND_TOKEN = "image"
K3_PLACEHOLDER = "<|kimi_image_placeholder|>"


def profile(v: VisionConfig, hf_processor: dict[str, Any], max_model_len: int, token_id) -> mf.VisionProfile:
    """The image profile (navit resize and padding, normalization, framing, limits) from the checkpoint's
    processor config; `token_id(text) -> id | None` resolves the framing tokens in its tokenizer.

    A tokenizer with K3's <|kimi_image_placeholder|> takes that as the placeholder and helios adds the
    framing; otherwise the template is taken to render K2.5's framing around one <|media_pad|>."""
    ip, settings = vc.processor_settings(hf_processor, PROCESSOR_DEFAULTS)
    size = ip.get("size") or {}
    if size:
        if size.get("max_height") is None or size.get("max_height") != size.get("max_width"):
            raise ValueError(f"size {size!r} is not a square {{max_height, max_width}} patch limit")
        settings["max_side"] = size["max_height"]
    vc.check_patching(settings, v, ("patch_size", "merge_size"))
    vc.check_resample(settings["resample"], 3, "bicubic")
    vc.check_switches(ip)
    ps, m = int(settings["patch_size"]), int(settings["merge_size"])
    budget, side = int(settings["max_patches"]), int(settings["max_side"])
    if budget < 2 * m * m or side < 2 * m:
        raise ValueError(f"max_patches {budget} / size {side} must allow at least two {m}x{m} tokens")
    names = (IMAGE_TOKEN, BEGIN_TOKEN, KIND_TOKEN, CONTENT_TOKEN, END_TOKEN)
    ids = {text: token_id(text) for text in names}
    if ids[IMAGE_TOKEN] is None or ids[IMAGE_TOKEN] != v.image_token_id:
        raise ValueError(f"image_token_id {v.image_token_id} is not the tokenizer's {IMAGE_TOKEN} ({ids[IMAGE_TOKEN]})")
    placeholder = token_id(K3_PLACEHOLDER)
    if placeholder is not None:  # helios frames each image as K2.5's template does
        missing = [text for text, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer lacks the image framing tokens {missing} (each one token)")
        prefix, suffix = (ids[BEGIN_TOKEN], ids[KIND_TOKEN], ids[CONTENT_TOKEN]), (ids[END_TOKEN],)
    else:  # the template renders the framing around one <|media_pad|>
        placeholder, prefix, suffix = v.image_token_id, (), ()
    framing = len(prefix) + len(suffix)
    # Patches before padding stay within the budget; padding to whole tokens adds at most a block row
    # and column. Images costing more (extreme aspect ratios) are refused per request with their size.
    per_image = max(0, min(budget // m**2 + side // m + 1, max_model_len - 1 - framing))
    return vc.image_profile(
        v,
        max_model_len,
        per_image=per_image,
        smallest=2,
        framing=framing,
        rescale_factor=settings["rescale_factor"],
        normalized=vc.normalization(ip, settings["image_mean"], settings["image_std"]),
        prefix=prefix,
        suffix=suffix,
        placeholder=placeholder,
        resize="navit",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=per_image * m * m,
        resample="torch_bicubic",
        patch_budget=budget,
        max_side_patches=side,
    )


# ---------------------------------------------------------------------------- the program


def _cubic_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Bicubic (Keys, a = -0.75, align_corners=False) taps [X, 4] into a `side`-long table for positions
    `index` [X] on an axis of `size` patches (a 0-d tensor), border-clamped, and their weights [X, 4]."""
    src = (index.float() + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = arange_like(index, 4, dtype=torch.int64) - 1
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    d = (src[:, None] - floor[:, None] - offsets).abs()
    a = -0.75
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, torch.where(d <= 1, near, far)


def _position_embedding(table: Tensor, positions: Tensor, side: int) -> Tensor:
    """The side x side learned table [side, side, h] resampled to the image's grid at each patch -> [X, h] fp32."""
    xs, ys = positions[:, 0], positions[:, 1]
    ty, wy = _cubic_taps(ys, ys.max() + 1, side)
    tx, wx = _cubic_taps(xs, xs.max() + 1, side)
    index = (ty[:, :, None] * side + tx[:, None, :]).reshape(-1, 16)
    weight = (wy[:, :, None] * wx[:, None, :]).reshape(-1, 16)
    rows = F.embedding(index, table.reshape(side * side, -1).float())  # [X, 16, h]
    return (rows * weight[:, :, None]).sum(dim=1)


class VisionProgram(vc.TowerProgram):
    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        patch = weights["vision.patch_embed"]  # [h, 3, p, p]: a linear over (channel, row, col) rows
        lin = vc.Linears(weights, patch.dtype)
        x = F.linear(pixel_values.to(patch.dtype), patch.reshape(v.hidden_size, -1), weights["vision.patch_embed.bias"])
        x = x.float() + _position_embedding(weights["vision.pos_embed"], pixel_positions, v.pos_emb_side)
        # Per frequency the x angle then the y angle, as Kimi_K25VisionRotaryEmbedding.
        xs, ys = pixel_positions[:, 0], pixel_positions[:, 1]
        cos_sin = vc.axial_cos_sin(xs, ys, v.head_dim, v.rope_theta, interleave=True)
        for i in range(v.num_layers):
            x = vc.encoder_layer(lin, f"vision.layers.{i}.", x, v.num_heads, cos_sin, v.hidden_act, LAYER_NORM_EPS)
        x = lin.norm("vision.proj_norm", lin.norm("vision.final_norm", x, LAYER_NORM_EPS), v.projection_eps)
        x = vc.merge_blocks(x, v.merge_size).flatten(1)  # each merge block's m^2 rows side by side
        return (lin("vision.proj2", F.gelu(lin("vision.proj1", x))),)


def example_inputs(v: VisionConfig) -> tuple[Tensor, Tensor]:
    """A 4 x 6 patch grid (2 x 3 tokens at m = 2): rows differ from columns, so neither specializes."""
    m = v.merge_size
    rows, cols = 2 * m, 3 * m
    pixels = torch.randn(rows * cols, v.patch_dim, generator=torch.Generator().manual_seed(0))
    return pixels, block_order(rows, cols, m)


# ---------------------------------------------------------------------- plain reference


def reference_features(v: VisionConfig, hf: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
    """Float64 tower + projector over Hugging Face names, written apart from the program: the patches
    reassembled into an image for a real Conv2d, the position table resampled by F.interpolate,
    rotary as complex rotations of (j, j + head_dim / 2) pairs, an explicit attention matrix, and the
    merge blocks read off the grid by position. -> [X / m^2, text hidden] fp32, blocks row-major."""
    f64 = torch.float64
    w = lambda name: hf[name].to(f64)  # noqa: E731
    ps, h, m = v.patch_size, v.hidden_size, v.merge_size
    rows, cols = vc.reference_grid(positions)
    image = vc.reference_clip(pixels, positions, ps, 1)[:, 0]
    grid = F.conv2d(image[None], w(_V + "patch_embed.proj.weight"), w(_V + "patch_embed.proj.bias"), stride=ps)[0]
    table = w(_V + "patch_embed.pos_emb.position_embeddings").permute(2, 0, 1)[None]  # [1, h, side, side]
    if (rows, cols) != (v.pos_emb_side, v.pos_emb_side):
        table = F.interpolate(table, size=(rows, cols), mode="bicubic", align_corners=False)
    x = (grid + table[0]).flatten(1).T  # [rows * cols, h] row-major

    def ln(u: Tensor, name: str, eps: float = LAYER_NORM_EPS) -> Tensor:
        return F.layer_norm(u, (h,), w(name + ".weight"), w(name + ".bias"), eps)

    # Channel pairs (j, j + hd/2) turn by angle[j]: even j the x position, odd j the y, frequency j // 2.
    half = v.head_dim // 2
    freqs = [v.rope_theta ** (-2 * (j // 2) / half) for j in range(half)]
    angle = torch.tensor(
        [[(c if j % 2 == 0 else r) * freqs[j] for j in range(half)] for r in range(rows) for c in range(cols)],
        dtype=f64,
    )
    turn = torch.polar(torch.ones_like(angle), angle)[:, None, :]

    def rotate(u: Tensor) -> Tensor:  # [N, H, hd]
        z = torch.complex(u[..., :half], u[..., half:]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    for i in range(v.num_layers):
        x = vc.reference_layer(w, LAYER, i, x, v.num_heads, rotate, v.hidden_act, LAYER_NORM_EPS)
    x = ln(ln(x, _V + "final_layernorm"), _PROJ + "pre_norm", v.projection_eps).view(rows, cols, h)
    u = vc.reference_activation(
        vc.reference_blocks(x, m) @ w(_PROJ + "in_proj.weight").T + w(_PROJ + "in_proj.bias"), "gelu"
    )
    return (u @ w(_PROJ + "out_proj.weight").T + w(_PROJ + "out_proj.bias")).float()


# ----------------------------------------------------------------------- test checkpoints (kimi_k3)

# Test vision checkpoints: the "kimi_k3-vision" chat flavour (testmodel.CHATS) plus K2.5's framing tokens.
TESTMODEL_VISION_TOKENS = (
    IMAGE_TOKEN,
    BEGIN_TOKEN,
    CONTENT_TOKEN,
    END_TOKEN,
    KIND_TOKEN,
    K3_PLACEHOLDER,
    "<|kimi_k25_video_placeholder|>",
)


def testmodel_vision(text: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """A tiny multimodal (Kimi_K25ForConditionalGeneration) config around testmodel_config's text model:
    a 2-layer vision tower of width 32 (2 heads of 16) over 14-pixel patches with an 8 x 8 learned
    position table (resampled up and down), 2 x 2 merging. `tokens`: TESTMODEL_VISION_TOKENS -> ids."""
    vision = {
        "model_type": "kimi_k25_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 14,
        "pos_emb_height": 8,
        "pos_emb_width": 8,
        "pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }
    return vc.nested_testmodel(
        "Kimi_K25ForConditionalGeneration",
        "kimi_k25",
        text,
        vision,
        projection_hidden_size=32,
        projection_layer_norm_eps=1e-5,
        image_token_id=tokens[IMAGE_TOKEN],
        video_token_id=tokens["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=tokens[BEGIN_TOKEN],
        vision_end_token_id=tokens[END_TOKEN],
    )


# Kimi_K25ImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json): at most 64
# patches before padding and 16 a side.
TESTMODEL_PROCESSOR = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "size": {"max_height": 16, "max_width": 16},
    "max_patches": 64,
    "patch_size": 14,
    "merge_size": 2,
    "resample": 3,
    "image_mean": list(PROCESSOR_DEFAULTS["image_mean"]),
    "image_std": list(PROCESSOR_DEFAULTS["image_std"]),
}
