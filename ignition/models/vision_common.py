"""The building blocks the vision towers share (glm5_next_vision, kimi_k25_vision, minimax_m3_vision,
muse_spark_vision, step3p7_vision, gemma4_vision); each tower module keeps only what is its own.

A tower's `vision` program (helios.core.program.vision_signature) maps one view of an image to its
tokens in the language model's embedding space:
    pixel_values [X, patch_dim] fp32, normalized   (one row per patch)
    pixel_positions [X, 2] int64                    ((x, y) patch coordinates)
    -> image_features [X / k^2, text hidden] fp32   (one row per k x k block of patches)
The merging towers (MergeTower: GLM-5.3, MiniMax M3, Kimi K2.5, Muse Spark) take their patches in
merge-block order (the m x m blocks row-major, the patches of a block row-major inside it), so block
b's patches are rows m^2 b .. m^2 b + m^2 - 1 and its token is row b; a ClipTower's patch rows hold
each patch's pixels in (channel, frame, row, col) order, the still image repeated over
t = temporal_patch_size frames (patch_dim 3 * t * patch^2).

- Config: `Tower` / `MergeTower` / `ClipTower`, the frozen VisionConfig bases (the fields every tower
  has; head_dim, pooling_kernel_size, patch_dim), and the checks of transformers' vision_config dicts.
- Weight names: `EncoderLayout`, transformers' names of a pre-norm encoder layer (LayerNorm, MHA with
  biases, LayerNorm, two-linear MLP) and its weight map and test-checkpoint shapes; `hub_renamed` and
  `split_fused_qkv` for checkpoints in a vendor's own layout.
- Profile: the processor-config reading and the VisionProfile fields every tower fills alike.
- Program: `TowerProgram`, `Linears` (a program's linears and LayerNorms over its weights), the 2-D
  rotary tables, attention, one encoder layer and the merge-block gather; each as the towers wrote it,
  op for op, so the exported numerics are unchanged.
- Reference (float64, written apart from the program helpers): the clip reassembly, activations,
  rotation, an explicit attention matrix, one encoder layer and the merge-block read-off.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core import manifest as mf
from ignition.models.common import arange_like, rotate_half
from ignition.models.naming import biased_shapes, with_biases

# ---------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class Tower:
    """What every tower's frozen VisionConfig holds (each family's subclass adds its own fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden_size: int  # the language model's width: image_features' columns
    image_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, slots=True)
class MergeTower(Tower):
    """A tower over square patches that merges m x m of them into one token."""

    patch_size: int
    merge_size: int  # m

    @property
    def pooling_kernel_size(self) -> int:
        """Patches per token side (the profile's pooling_kernel_size): the spatial merge."""
        return self.merge_size


@dataclass(frozen=True, slots=True)
class ClipTower(MergeTower):
    """A merging tower whose patches are clips: the still image repeated over temporal_patch_size frames."""

    temporal_patch_size: int

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


def activation(v: Mapping[str, Any], key: str, default: str, allowed: Sequence[str], family: str) -> str:
    """vision_config[key] (else `default`), one of `allowed`; else ValueError."""
    act = v.get(key) or default
    if act not in allowed:
        raise ValueError(f"vision {key} {act!r} is not supported by the {family} family ({', '.join(allowed)})")
    return act


def axial_rope(v: Mapping[str, Any]) -> Mapping[str, Any]:
    """vision_config's rope_parameters (empty if absent); a rope_type other than axial raises ValueError."""
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported (axial is)")
    return rope


def axial_theta(v: Mapping[str, Any]) -> float:
    """The axial rotary's base (rope_parameters' rope_theta, else vision_config's own, else 10000); a
    rope_type other than axial raises ValueError."""
    return float(axial_rope(v).get("rope_theta", v.get("rope_theta", 10000.0)))


def check_rgb(v: Mapping[str, Any], key: str = "num_channels") -> None:
    if int(v.get(key, 3)) != 3:
        raise ValueError(f"vision {key} other than 3 is not supported")


def check_heads(hidden: int, heads: int) -> None:
    """A 2-D rotary over the whole head: head_dim a whole multiple of 4."""
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(
            f"vision hidden_size {hidden} over {heads} heads must give a head_dim divisible by 4 "
            "(the 2-D rotary covers the whole head)"
        )


# ---------------------------------------------------------------------------- weight names


@dataclass(frozen=True, slots=True)
class EncoderLayout:
    """transformers' names of a pre-norm encoder layer under `prefix` (with `{}` for the layer): q, k, v
    and output projections under `attention` ("attn." or "self_attn."; the output one `output`),
    mlp.fc1 and mlp.fc2, and the two LayerNorms `norms`; every one a weight and a bias. Ours: wq wk wv
    wo, fc1 fc2, norm1 norm2 under vision.layers.{i}."""

    prefix: str
    attention: str
    output: str
    norms: tuple[str, str]

    @property
    def projections(self) -> tuple[str, str, str, str]:
        a = self.attention
        return (a + "q_proj", a + "k_proj", a + "v_proj", a + self.output)

    def layer(self, i: int | str) -> str:
        return self.prefix.format(i)

    def weight_map(self) -> dict[str, str]:
        """transformers' names -> ours."""
        theirs = (*self.projections, "mlp.fc1", "mlp.fc2", *self.norms)
        ours = ("wq", "wk", "wv", "wo", "fc1", "fc2", "norm1", "norm2")
        return with_biases(self.prefix, "vision.layers.{}.", zip(theirs, ours))

    def shapes(
        self, layers: int, hidden: int, intermediate: int, extra: Mapping[str, tuple[int, ...]] | None = None
    ) -> dict[str, tuple[int, ...]]:
        """Test-checkpoint shapes of `layers` layers, layer by layer: projections, MLP, `extra` (names
        under the layer's prefix), norms."""
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(layers):
            p = self.layer(i)
            shapes |= biased_shapes(p, self.projections, hidden, hidden)
            shapes |= biased_shapes(p, ("mlp.fc1",), intermediate, hidden) | biased_shapes(
                p, ("mlp.fc2",), hidden, intermediate
            )
            shapes |= {p + name: shape for name, shape in (extra or {}).items()}
            shapes |= biased_shapes(p, self.norms, hidden)
        return shapes


def hub_renamed(name: str, renames: Iterable[tuple[str, str]]) -> str | None:
    """`name` rewritten by the first (pattern, replacement) that changes it, else None."""
    for pattern, replacement in renames:
        renamed = re.sub(pattern, replacement, name)
        if renamed != name:
            return renamed
    return None


def split_fused_qkv(tensor: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """A fused [q; k; v] weight or bias split in three, q and k rows permuted per head from interleaved
    (complex) rotary pairs to rotate-half's halves (transformers' PermuteForRope)."""
    q, k, v = tensor.chunk(3, dim=0)

    def halves(t: Tensor) -> Tensor:
        pairs = t.shape[0] // num_heads // 2
        return t.reshape(num_heads, pairs, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()

    return halves(q), halves(k), v.contiguous()


def nested_testmodel(
    architecture: str, model_type: str, text: Mapping[str, Any], vision: Mapping[str, Any], **top: Any
) -> dict[str, Any]:
    """A tiny multimodal ForConditionalGeneration config (`architecture`, `model_type`) nesting
    testmodel_config's text model `text` (its architectures left out) as text_config beside the
    `vision` config, with `top`'s fields; embeddings tied as the text model's, and its
    max_position_embeddings also at the top, where testmodel reads it."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": dict(vision),
        **top,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "max_position_embeddings": text["max_position_embeddings"],
    }


# ---------------------------------------------------------------------------- image profile


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's normalization, many processors' default
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN / _STD: pixels to [-1, 1]
STANDARD_STD = (0.5, 0.5, 0.5)


def processor_defaults(mean: tuple[float, ...], std: tuple[float, ...], **own: Any) -> dict[str, Any]:
    """A Qwen2-VL-style image processor's class defaults: 14-pixel patches of 2 frames, 2 x 2 merging,
    rescaling by 1/255, bicubic (3) resampling, normalization by `mean` / `std`; `own`: the processor's
    further settings and its overrides of these."""
    shared = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "rescale_factor": 1 / 255, "resample": 3}
    return shared | {"image_mean": mean, "image_std": std} | own


def processor_settings(
    hf_processor: Mapping[str, Any], defaults: Mapping[str, Any]
) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """(the image processor's config, its `defaults` keys with the config's values where set)."""
    ip = hf_processor.get("image_processor", hf_processor)
    return ip, {k: ip.get(k) if ip.get(k) is not None else d for k, d in defaults.items()}


def check_patching(settings: Mapping[str, Any], v: Any, names: Sequence[str]) -> None:
    """The processor's patching settings `names` equal the tower's fields of those names."""
    theirs, ours = tuple(int(settings[n]) for n in names), tuple(getattr(v, n) for n in names)
    if theirs != ours:
        raise ValueError(f"the processor's {' / '.join(names)} {theirs} differ from the vision tower's {ours}")


def check_resample(value: Any, supported: int, label: str) -> None:
    if int(value) != supported:
        raise ValueError(f"resample {value} is not supported ({label}, {supported}, is)")


def check_switches(ip: Mapping[str, Any]) -> None:
    if ip.get("do_rescale") is False or ip.get("do_convert_rgb") is False or ip.get("do_resize") is False:
        raise ValueError("do_rescale, do_resize and do_convert_rgb must stay on")


def framing_ids(
    token_id: Callable[[str], int | None], image_token: str, others: Sequence[str], v: Any
) -> dict[str, int]:
    """The tokenizer's ids of `image_token` (which must be the config's image_token_id) and `others`."""
    ids = {text: token_id(text) for text in (image_token, *others)}
    missing = [text for text, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the image framing tokens {missing}")
    if ids[image_token] != v.image_token_id:
        raise ValueError(f"image_token_id {v.image_token_id} is not the tokenizer's {image_token} ({ids[image_token]})")
    return ids  # type: ignore[return-value]


def normalization(
    ip: Mapping[str, Any], mean: Sequence[float], std: Sequence[float], default: bool = True
) -> dict[str, tuple[float, ...]]:
    """image_mean / image_std as the profile stores them: identity when do_normalize is off."""
    if ip.get("do_normalize", default):
        return {"image_mean": tuple(float(x) for x in mean), "image_std": tuple(float(x) for x in std)}
    return {"image_mean": (0.0, 0.0, 0.0), "image_std": (1.0, 1.0, 1.0)}


def image_profile(
    v: Any,
    max_model_len: int,
    *,
    per_image: int,
    smallest: int,
    framing: int,
    rescale_factor: float,
    normalized: Mapping[str, tuple[float, ...]],
    prefix: tuple[int, ...] = (),
    suffix: tuple[int, ...] = (),
    placeholder: int | None = None,
    **rule: Any,
) -> mf.VisionProfile:
    """A tower's VisionProfile: `rule` (resize, patch_size, pooling_kernel_size, max_patches, resample and
    the resize rule's own fields) plus what every tower fills alike: the image token (also the
    placeholder unless given), framing, feature width, normalization and the /v1/models limits for
    `per_image` tokens an image, at least `smallest`, each framed by `framing` tokens."""
    return mf.VisionProfile(
        rescale_factor=float(rescale_factor),
        placeholder_token_id=v.image_token_id if placeholder is None else placeholder,
        image_token_id=v.image_token_id,
        prefix_token_ids=prefix,
        suffix_token_ids=suffix,
        feature_dim=v.text_hidden_size,
        max_images_per_prompt=max(0, (max_model_len - 1) // (smallest + framing)),
        max_image_tokens_per_prompt=max(0, max_model_len - 1 - framing),
        image_feature_window_tokens=per_image,
        max_image_tokens_per_image=per_image,
        max_image_pixels=50_000_000,
        max_image_bytes=20 << 20,
        **normalized,
        **rule,
    )


# ---------------------------------------------------------------------------- the program


class TowerProgram(torch.nn.Module):
    """forward(weights, kv_cache, pixel_values, pixel_positions) -> (image_features,); kv_cache is unused (empty)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config


class Linears:
    """A program's linears (in the weights' dtype, fp32 out, the ".bias" added where the weights hold
    one) and LayerNorms (fp32) over its weights."""

    def __init__(self, weights: Mapping[str, Tensor], dtype: torch.dtype) -> None:
        self.weights, self.dtype = weights, dtype

    def __call__(self, name: str, x: Tensor) -> Tensor:
        return F.linear(x.to(self.dtype), self.weights[name], self.weights.get(name + ".bias")).float()

    def norm(self, name: str, x: Tensor, eps: float) -> Tensor:
        w = self.weights
        return F.layer_norm(x, (x.shape[-1],), w[name].float(), w[name + ".bias"].float(), eps)


def activation_fn(name: str, x: Tensor) -> Tensor:
    """The towers' MLP activations: quick_gelu, gelu_pytorch_tanh, gelu (exact) and silu."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def inverse_frequencies(width: int, theta: float, like: Tensor) -> Tensor:
    """1 / theta^(2j / width) for j < width / 2: a rotary's frequencies over `width` channels (on `like`'s device)."""
    return 1.0 / (theta ** (arange_like(like, width, 2) / width))


def rope_tables(angles: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, 2 * A] of angles [X, A], the set repeated for rotate-half."""
    ang = torch.cat([angles, angles], dim=-1)
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def axial_cos_sin(
    first: Tensor, second: Tensor, head_dim: int, theta: float, interleave: bool = False
) -> tuple[Tensor, Tensor]:
    """cos, sin [X, 1, head_dim] of a 2-D rotary over the whole head: head_dim / 4 frequencies of the
    `first` coordinate, then of the `second` (or, `interleave`d, per frequency the first then the second)."""
    inv = inverse_frequencies(head_dim // 2, theta, first)
    a, b = first.float()[:, None] * inv, second.float()[:, None] * inv
    ang = torch.stack([a, b], dim=-1).reshape(first.shape[0], head_dim // 2) if interleave else torch.cat([a, b], -1)
    return rope_tables(ang)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary over x's first cos.shape[-1] channels (the rest pass through); Step 3.7's text
    attention rotates with it too."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :width], x[..., width:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention of every row over every row (`mask`: which may attend) [X, H, hd] -> [X, H * hd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1).reshape(-1, q.shape[1] * q.shape[2])


def encoder_layer(
    lin: Linears,
    prefix: str,
    x: Tensor,
    num_heads: int,
    cos_sin: tuple[Tensor, Tensor],
    act: str,
    eps: float,
    mask: Tensor | None = None,
    layer_scale: bool = False,
) -> Tensor:
    """One pre-norm encoder layer under `prefix` (ours: norm1, wq wk wv with the rotary on q and k, wo,
    norm2, fc1 -> act -> fc2; `layer_scale`: each branch times scale1 / scale2)."""
    h = x.shape[-1]
    y = lin.norm(prefix + "norm1", x, eps)
    q, k, val = (lin(prefix + name, y).reshape(-1, num_heads, h // num_heads) for name in ("wq", "wk", "wv"))
    q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
    out = lin(prefix + "wo", attention(q, k, val, mask))
    x = x + (lin.weights[prefix + "scale1"].float() * out if layer_scale else out)
    out = lin(prefix + "fc2", activation_fn(act, lin(prefix + "fc1", lin.norm(prefix + "norm2", x, eps))))
    return x + (lin.weights[prefix + "scale2"].float() * out if layer_scale else out)


def merge_blocks(x: Tensor, m: int) -> Tensor:
    """Rows [X, C] in merge-block order -> [X / m^2, m^2, C]: each block's m^2 consecutive rows,
    gathered so every shape follows X."""
    group = m * m
    n = x.shape[0] // group
    rows = arange_like(x, n, dtype=torch.int64)[:, None] * group + arange_like(x, group, dtype=torch.int64)[None, :]
    return x[rows]


# ---------------------------------------------------------------------------- plain reference


def reference_grid(positions: Tensor) -> tuple[int, int]:
    """(rows, cols) of a full patch grid from its (x, y) positions."""
    return int(positions[:, 1].max()) + 1, int(positions[:, 0].max()) + 1


def reference_clip(pixels: Tensor, positions: Tensor, patch_size: int, frames: int) -> Tensor:
    """Patch rows (channel, frame, row, col) put back on their grid: [3, frames, rows * p, cols * p] float64."""
    ps = patch_size
    rows, cols = reference_grid(positions)
    clip = torch.zeros(3, frames, rows * ps, cols * ps, dtype=torch.float64)
    for (x, y), patch in zip(positions.tolist(), pixels.to(torch.float64)):
        clip[:, :, y * ps : (y + 1) * ps, x * ps : (x + 1) * ps] = patch.view(3, frames, ps, ps)
    return clip


def reference_activation(u: Tensor, name: str) -> Tensor:
    """The activations from their formulas: quick_gelu, gelu_pytorch_tanh, silu, else exact GELU."""
    if name == "quick_gelu":
        return u / (1 + torch.exp(-1.702 * u))
    if name == "gelu_pytorch_tanh":
        return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    if name == "silu":
        return u / (1 + torch.exp(-u))
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def reference_rotate(u: Tensor, angle: Tensor) -> Tensor:
    """u [N, H, hd]: channel pairs (j, j + A) turn by angle[:, j] (angle [N, A]); channels past 2A pass."""
    half = angle.shape[-1]
    a, b, rest = u[..., :half], u[..., half : 2 * half], u[..., 2 * half :]
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """An explicit attention matrix: [N, H, hd] -> [N, H, hd]."""
    scores = torch.einsum("qhd,khd->hqk", q, k)
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_layer(
    w: Callable[[str], Tensor],
    layout: EncoderLayout,
    i: int,
    x: Tensor,
    num_heads: int,
    rotate: Callable[[Tensor], Tensor],
    act: str,
    eps: float,
    attend: Callable[[Tensor, Tensor, Tensor], Tensor] = reference_attention,
    scales: tuple[str, str] | None = None,
) -> Tensor:
    """Encoder layer `i` of `layout` over transformers' names, float64: `attend` the attention of
    rotated q, k and v [N, H, hd]; `scales`: the names of the branches' layer scales."""
    h, prefix = x.shape[-1], layout.layer(i)

    def affine(u: Tensor, name: str) -> Tensor:
        return u @ w(prefix + name + ".weight").T + w(prefix + name + ".bias")

    def ln(u: Tensor, name: str) -> Tensor:
        return F.layer_norm(u, (h,), w(prefix + name + ".weight"), w(prefix + name + ".bias"), eps)

    def add(x: Tensor, u: Tensor, name: str, scale: int) -> Tensor:
        if scales is None:
            return x + u @ w(prefix + name + ".weight").T + w(prefix + name + ".bias")
        return x + w(prefix + scales[scale]) * affine(u, name)

    q_name, k_name, v_name, o_name = layout.projections
    y = ln(x, layout.norms[0])
    q, k, val = (affine(y, n).view(-1, num_heads, h // num_heads) for n in (q_name, k_name, v_name))
    x = add(x, attend(rotate(q), rotate(k), val).reshape(-1, h), o_name, 0)
    return add(x, reference_activation(affine(ln(x, layout.norms[1]), "mlp.fc1"), act), "mlp.fc2", 1)


def reference_blocks(x: Tensor, m: int, interleave: bool = False) -> Tensor:
    """x [rows, cols, C] -> one row per m x m block, blocks row-major: the block's patches row-major
    side by side (`interleave`: channel by channel) -> [blocks, m^2 * C]."""
    rows, cols = x.shape[0], x.shape[1]
    tokens = []
    for by in range(rows // m):
        for bx in range(cols // m):
            patches = [x[by * m + dy, bx * m + dx] for dy in range(m) for dx in range(m)]
            tokens.append(torch.stack(patches, dim=-1).reshape(-1) if interleave else torch.cat(patches))
    return torch.stack(tokens)
