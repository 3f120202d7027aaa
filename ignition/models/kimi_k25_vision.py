"""Kimi K2.5's vision tower and projector (Kimi_K25Model's vision_tower + mm_projector), one program.

The `vision` program (helios.core.program.vision_signature) maps one image to its tokens in the
language model's embedding space:
    pixel_values [X, 3 * patch^2] fp32, normalized   (each patch's pixels in (channel, row, col) order)
    pixel_positions [X, 2] int64                     ((x, y) patch coordinates)
    -> image_features [X / m^2, text hidden] fp32    (one row per m x m merge block)
Patches come in merge-block order (the m x m blocks row-major, the patches of a block row-major
inside it; transformers' Kimi_K25ImageProcessor lays them out row-major and its temporal_merge
gathers them into this order), so block b's patches are rows m^2 b .. m^2 b + m^2 - 1. Inside, as
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
from ignition.models.patch_grid import block_order

_V = "model.vision_tower."
_VL = _V + "layers.{}."
_PROJ = "model.mm_projector."
# transformers' in-memory layout (what Kimi_K25ForConditionalGeneration.state_dict() holds).
WEIGHT_MAP = {
    _V + "patch_embed.proj.weight": "vision.patch_embed",
    _V + "patch_embed.proj.bias": "vision.patch_embed.bias",
    _V + "patch_embed.pos_emb.position_embeddings": "vision.pos_embed",
    _V + "final_layernorm.weight": "vision.final_norm",
    _V + "final_layernorm.bias": "vision.final_norm.bias",
    **with_biases(_PROJ, "vision.", (("pre_norm", "proj_norm"), ("in_proj", "proj1"), ("out_proj", "proj2"))),
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
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rope_theta: float
    hidden_act: str  # one of ACTIVATIONS (the tower's MLP; the projector's is always exact GELU)
    patch_size: int
    pos_emb_side: int  # the learned position table is pos_emb_side x pos_emb_side
    merge_size: int  # m: m x m patches merge into one token
    projection_eps: float
    text_hidden_size: int
    image_token_id: int

    @property
    def pooling_kernel_size(self) -> int:
        """Patches per token side (the profile's pooling_kernel_size): the merge kernel."""
        return self.merge_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2


def image_token_id(top: dict[str, Any]) -> int:
    """transformers' image_token_id, else Moonshot's media_placeholder_token_id, else the class default."""
    return int(top.get("image_token_id", top.get("media_placeholder_token_id", DEFAULT_IMAGE_TOKEN_ID)))


def config_from_hf(top: dict[str, Any], text: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Kimi_K25Config dict, as transformers reads it; unsupported variants raise ValueError."""
    v = top["vision_config"]
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {act!r} is not supported by the kimi_k3 family ({ACTIVATIONS})")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported (axial is)")
    hidden, heads = int(v.get("hidden_size", 1152)), int(v.get("num_attention_heads", 16))
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"vision hidden_size {hidden} over {heads} heads is not a head_dim divisible by 4")
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
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_layers=int(v.get("num_hidden_layers", 27)),
        num_heads=heads,
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        hidden_act=act,
        patch_size=int(v.get("patch_size", 14)),
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
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                if part != "v_proj":
                    rows = t.shape[0]
                    t = t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
                out[_VL.format(layer) + f"attn.{part}.{kind}"] = t.contiguous()
            continue
        for pattern, replacement in _HUB_RENAMES:
            renamed = re.sub(pattern, replacement, name)
            if renamed != name:
                name = renamed
                break
        out[name] = tensor
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
    for i in range(v.num_layers):
        q = _VL.format(i)
        shapes |= biased_shapes(q, ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj"), h, h)
        shapes |= biased_shapes(q, ("mlp.fc1",), f, h) | biased_shapes(q, ("mlp.fc2",), h, f)
        shapes |= biased_shapes(q, ("norm1", "norm2"), h)
    return shapes


# Kimi_K25ImageProcessor's class defaults (its preprocessor_config.json may override them).
PROCESSOR_DEFAULTS = {
    "max_patches": 16384,
    "max_side": 512,
    "patch_size": 14,
    "merge_size": 2,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
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
    ip = hf_processor.get("image_processor", hf_processor)
    settings = {k: ip.get(k) if ip.get(k) is not None else d for k, d in PROCESSOR_DEFAULTS.items()}
    size = ip.get("size") or {}
    if size:
        if size.get("max_height") is None or size.get("max_height") != size.get("max_width"):
            raise ValueError(f"size {size!r} is not a square {{max_height, max_width}} patch limit")
        settings["max_side"] = size["max_height"]
    ps, m = int(settings["patch_size"]), int(settings["merge_size"])
    if (ps, m) != (v.patch_size, v.merge_size):
        raise ValueError(
            f"the processor's patch_size / merge_size ({ps}, {m}) differ from the vision tower's "
            f"({v.patch_size}, {v.merge_size})"
        )
    if int(settings["resample"]) != 3:
        raise ValueError(f"resample {settings['resample']} is not supported (bicubic, 3, is)")
    if ip.get("do_rescale") is False or ip.get("do_convert_rgb") is False or ip.get("do_resize") is False:
        raise ValueError("do_rescale, do_resize and do_convert_rgb must stay on")
    budget, side = int(settings["max_patches"]), int(settings["max_side"])
    if budget < 2 * m * m or side < 2 * m:
        raise ValueError(f"max_patches {budget} / size {side} must allow at least two {m}x{m} tokens")
    normalize = ip.get("do_normalize", True)
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
    return mf.VisionProfile(
        resize="navit",
        patch_size=ps,
        pooling_kernel_size=m,
        max_patches=per_image * m * m,
        resample="torch_bicubic",
        rescale_factor=float(settings["rescale_factor"]),
        image_mean=tuple(float(x) for x in settings["image_mean"]) if normalize else (0.0, 0.0, 0.0),
        image_std=tuple(float(x) for x in settings["image_std"]) if normalize else (1.0, 1.0, 1.0),
        placeholder_token_id=placeholder,
        image_token_id=v.image_token_id,
        prefix_token_ids=prefix,
        suffix_token_ids=suffix,
        feature_dim=v.text_hidden_size,
        max_images_per_prompt=max(0, (max_model_len - 1) // (2 + framing)),
        max_image_tokens_per_prompt=max(0, max_model_len - 1 - framing),
        image_feature_window_tokens=per_image,
        max_image_tokens_per_image=per_image,
        max_image_pixels=50_000_000,
        max_image_bytes=20 << 20,
        patch_budget=budget,
        max_side_patches=side,
    )


# ---------------------------------------------------------------------------- the program


def _activation(name: str, x: Tensor) -> Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def _cubic_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Bicubic (Keys, a = -0.75, align_corners=False) taps [X, 4] into a `side`-long table for positions
    `index` [X] on an axis of `size` patches (a 0-d tensor), border-clamped, and their weights [X, 4]."""
    src = (index.float() + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(-1, 3, device=index.device)
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


def _rotary_cos_sin(positions: Tensor, v: VisionConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, head_dim]: per frequency f the x angle then the y angle, the set repeated for
    rotate-half, as Kimi_K25VisionRotaryEmbedding."""
    d = v.head_dim // 2
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
    fx = positions[:, 0].float()[:, None] * inv
    fy = positions[:, 1].float()[:, None] * inv
    ang = torch.stack([fx, fy], dim=-1).reshape(positions.shape[0], d)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


class VisionProgram(torch.nn.Module):
    """forward(weights, kv_cache, pixel_values, pixel_positions) -> (image_features,); kv_cache is unused (empty)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, weights, kv_cache, pixel_values, pixel_positions):
        v = self.config
        h, H, hd, eps = v.hidden_size, v.num_heads, v.head_dim, LAYER_NORM_EPS
        patch = weights["vision.patch_embed"]  # [h, 3, p, p]: a linear over (channel, row, col) rows
        wdt = patch.dtype

        def lin(name: str, t: Tensor) -> Tensor:
            return F.linear(t.to(wdt), weights[name], weights[name + ".bias"]).float()

        def norm(name: str, t: Tensor, e: float = eps) -> Tensor:
            return F.layer_norm(t, (h,), weights[name].float(), weights[name + ".bias"].float(), e)

        x = F.linear(pixel_values.to(wdt), patch.reshape(h, -1), weights["vision.patch_embed.bias"]).float()
        x = x + _position_embedding(weights["vision.pos_embed"], pixel_positions, v.pos_emb_side)
        cos, sin = _rotary_cos_sin(pixel_positions, v)
        for i in range(v.num_layers):
            p = f"vision.layers.{i}."
            y = norm(p + "norm1", x)
            q, k, val = (lin(p + name, y).reshape(-1, H, hd) for name in ("wq", "wk", "wv"))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), val.transpose(0, 1))
            x = x + lin(p + "wo", attn.transpose(0, 1).reshape(-1, h))
            x = x + lin(p + "fc2", _activation(v.hidden_act, lin(p + "fc1", norm(p + "norm2", x))))
        x = norm("vision.proj_norm", norm("vision.final_norm", x), v.projection_eps)
        # Each merge block's m^2 consecutive rows side by side, gathered so every shape follows X.
        group = v.merge_size**2
        n = x.shape[0] // group
        rows = torch.arange(n, device=x.device)[:, None] * group + torch.arange(group, device=x.device)[None, :]
        x = x[rows].reshape(n, group * h)
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
    ps, h, H, m = v.patch_size, v.hidden_size, v.num_heads, v.merge_size
    hd = h // H
    rows, cols = int(positions[:, 1].max()) + 1, int(positions[:, 0].max()) + 1
    image = torch.zeros(3, rows * ps, cols * ps, dtype=f64)
    for (x, y), patch in zip(positions.tolist(), pixels.to(f64)):
        image[:, y * ps : (y + 1) * ps, x * ps : (x + 1) * ps] = patch.view(3, ps, ps)
    grid = F.conv2d(image[None], w(_V + "patch_embed.proj.weight"), w(_V + "patch_embed.proj.bias"), stride=ps)[0]
    table = w(_V + "patch_embed.pos_emb.position_embeddings").permute(2, 0, 1)[None]  # [1, h, side, side]
    if (rows, cols) != (v.pos_emb_side, v.pos_emb_side):
        table = F.interpolate(table, size=(rows, cols), mode="bicubic", align_corners=False)
    x = (grid + table[0]).flatten(1).T  # [rows * cols, h] row-major

    def ln(u: Tensor, name: str, eps: float = LAYER_NORM_EPS) -> Tensor:
        return F.layer_norm(u, (h,), w(name + ".weight"), w(name + ".bias"), eps)

    def act(u: Tensor, name: str) -> Tensor:
        if name == "quick_gelu":
            return u / (1 + torch.exp(-1.702 * u))
        if name == "gelu_pytorch_tanh":
            return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))

    # Channel pairs (j, j + hd/2) turn by angle[j]: even j the x position, odd j the y, frequency j // 2.
    half = hd // 2
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
        p = _VL.format(i)
        y = ln(x, p + "norm1")
        q, k, val = (y @ w(p + f"attn.{n}.weight").T + w(p + f"attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj"))
        q, k, val = rotate(q.view(-1, H, hd)), rotate(k.view(-1, H, hd)), val.view(-1, H, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(-1, h)
        x = x + attn @ w(p + "attn.proj.weight").T + w(p + "attn.proj.bias")
        y = act(ln(x, p + "norm2") @ w(p + "mlp.fc1.weight").T + w(p + "mlp.fc1.bias"), v.hidden_act)
        x = x + y @ w(p + "mlp.fc2.weight").T + w(p + "mlp.fc2.bias")
    x = ln(ln(x, _V + "final_layernorm"), _PROJ + "pre_norm", v.projection_eps).view(rows, cols, h)
    tokens = torch.stack(
        [
            torch.cat([x[by * m + dy, bx * m + dx] for dy in range(m) for dx in range(m)])
            for by in range(rows // m)
            for bx in range(cols // m)
        ]
    )
    u = act(tokens @ w(_PROJ + "in_proj.weight").T + w(_PROJ + "in_proj.bias"), "gelu")
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
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {
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
        },
        "projection_hidden_size": 32,
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": tokens[IMAGE_TOKEN],
        "video_token_id": tokens["<|kimi_k25_video_placeholder|>"],
        "vision_start_token_id": tokens[BEGIN_TOKEN],
        "vision_end_token_id": tokens[END_TOKEN],
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "max_position_embeddings": text["max_position_embeddings"],  # also at the top, where testmodel reads it
    }


# Kimi_K25ImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json): at most 64
# patches before padding and 16 a side.
TESTMODEL_PROCESSOR = {
    "image_processor_type": "Kimi_K25ImageProcessor",
    "size": {"max_height": 16, "max_width": 16},
    "max_patches": 64,
    "patch_size": 14,
    "merge_size": 2,
    "resample": 3,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
