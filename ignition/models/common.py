"""Pieces the families share: weight-name maps of the common tensors, the pre-norm GQA decoder
(`DecoderProgram`: llama, qwen3, qwen3_moe, gemma3 override its q/k and MLP hooks), norms, rotary,
hyper-connections, MLPs, the test-checkpoint shapes, and an independent plain-torch reference forward
over Hugging Face-named weights that the export self-check compares the saved programs against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models.step import StepInputs, StepModule, cached_attention

# Hugging Face name -> internal name ("{}": the layer) of the pieces most families share.
HEAD_WEIGHT_MAP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
QKVO_WEIGHT_MAP = {f"model.layers.{{}}.self_attn.{p}_proj.weight": f"layers.{{}}.w{p}" for p in "qkvo"}
QK_NORM_WEIGHT_MAP = {  # per-head q/k RMSNorm (Qwen3, Gemma)
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.q_norm",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.k_norm",
}
SWIGLU_WEIGHT_MAP = {f"model.layers.{{}}.mlp.{p}_proj.weight": f"layers.{{}}.w_{p}" for p in ("gate", "up", "down")}
# A pre-norm layer's norms: before attention, and before the MLP.
PRE_NORM_WEIGHT_MAP = {
    "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm",
}
# The embedding, final norm, head and a pre-norm attention block (no MLP).
ATTENTION_WEIGHT_MAP = {**HEAD_WEIGHT_MAP, **PRE_NORM_WEIGHT_MAP, **QKVO_WEIGHT_MAP}


def hyper_weight_map(source: str) -> dict[str, str]:
    """The attention and MLP blocks' hyper-connection tensors (fn, base, scale): `source` with its "{block}"
    and "{part}" filled in (e.g. "model.layers.{}.{block}_hc.{part}") -> "layers.{}.{block}_hc.{part}"."""
    blocks, parts = ("attn", "ffn"), ("fn", "base", "scale")
    name = lambda b, p: source.replace("{block}", b).replace("{part}", p)  # noqa: E731
    return {name(b, p): f"layers.{{}}.{b}_hc.{p}" for b in blocks for p in parts}


# llama.cpp's GGUF tensor names (convert_hf_to_gguf) -> Hugging Face names, of the pieces above.
GGUF_DECODER_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    **{
        f"blk.{{}}.attn_{g}.weight": f"model.layers.{{}}.self_attn.{h}_proj.weight"
        for g, h in zip(("q", "k", "v", "output"), "qkvo")
    },
    **{f"blk.{{}}.ffn_{p}.weight": f"model.layers.{{}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
DENSE_FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}


class CacheConfig(Protocol):
    """What the default kv_shape reads from a family's frozen config (DecoderFields and most others)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class AttentionStack:
    """The shape of a stack of RMS-normed GQA attention layers with rotary positions: a decoder's
    (DecoderFields) and Gemma 4's vision tower's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


@dataclass(frozen=True, slots=True)
class DecoderFields(AttentionStack):
    """The config fields of a GQA decoder that families read the same way (`decoder_fields`); a
    family's config adds its MLP sizes and whatever else it has."""

    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class DenseConfig(DecoderFields):
    """A decoder with one dense SwiGLU MLP per layer (Llama, Qwen3)."""

    intermediate_size: int


def decoder_fields(hf: dict[str, Any], family: str, default_positions: int) -> dict[str, Any]:
    """The config fields every decoder family reads the same way (all but the MLP sizes)."""
    heads = int(hf["num_attention_heads"])
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta_from_hf(hf, family),
        "max_position_embeddings": int(hf.get("max_position_embeddings", default_positions)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def kv_shape(config: CacheConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the paged cache."""
    return config.num_layers, config.num_kv_heads, config.head_dim


def decode_weight_bytes(config: Any, weights: dict[str, Tensor]) -> int:
    """Weights read per decode token: everything but the embedding table (one row is read),
    except when tied, where the table is the output projection and is read whole."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if "lm_head" in weights:
        total -= weights["embed"].numel() * weights["embed"].element_size()
    return total


def rope_theta_from_hf(hf: dict[str, Any], family: str) -> float:
    """The rotary base of a config in either layout (`rope_theta` or transformers 5's
    `rope_parameters`); scaled rotary variants raise ValueError."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling!r} is not supported by the {family} family yet")
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


# ---------------------------------------------------------------------------- step program


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def arange_like(like: Tensor, end: int, step: int = 1, dtype: torch.dtype = torch.float32) -> Tensor:
    """torch.arange(0, end, step) in `dtype` (fp32 unless given) on `like`'s device, traced without a
    device constant (`end` may be a traced size).

    torch.export writes a factory's device (arange(..., device=x.device)) into the program as the
    export device, so the program would need that device at run time; new_ones takes its device from
    `like` when it runs. The values are exact (fp32: whole numbers below 2**24, as arange's .float())."""
    values = like.new_ones(-(-end // step), dtype=dtype).cumsum(0) - 1
    return values * step if step != 1 else values


def theta_powers(like: Tensor, dim: int, theta: float, pairs: int | None = None) -> Tensor:
    """[pairs] fp32 theta ** (-2j / dim), the rotary inverse frequencies, on `like`'s device; `pairs`
    defaults to ceil(dim / 2) (an odd rotary width has one more pair, as transformers' arange(0, dim, 2)).

    Computed as exp(-2j/dim * ln theta) in fp64 and rounded once to fp32 (the correctly rounded
    value, as an exact pow would give). Written with exp on purpose: Inductor keeps a pointwise
    value inside every consumer unless it holds a costly op (exp or log on the CPU), so a
    theta ** x left the pow, cos and sin of the rotary tables recomputed per element in every
    layer's attention prologue of a compiled step; with exp the tables are computed once a step."""
    pairs = (dim + 1) // 2 if pairs is None else pairs
    exponents = arange_like(like, 2 * pairs, 2, dtype=torch.float64) / dim
    return torch.exp(exponents * -math.log(theta)).float()


def rope(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype | None = None, factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, D] fp32 of rotary embeddings (cast to `dtype` where given); `factor` > 1 is
    linear position scaling (inv_freq / factor)."""
    inv_freq = theta_powers(positions, head_dim, theta)
    if factor != 1.0:
        inv_freq = inv_freq / factor
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    if dtype is None:
        return emb.cos()[:, None, :], emb.sin()[:, None, :]
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]: rotate-half rotary over the first cos.shape[-1] dims of each head; the rest passes."""
    dim = cos.shape[-1]
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """Weightless RMSNorm over the last dim (fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def offset_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32 whose weight stores the offset from one: x / rms(x) * (1 + w) (Gemma 3's,
    Qwen3-Next's, MiniMax-M3's, Step 3.7's, Muse Spark's centered norm)."""
    return unit_rms(x.float(), eps) * (1.0 + weight.float())


def hyper_connection(
    streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Manifold-constrained hyper-connections (mHC) before a block, as transformers' DeepseekV4HyperConnection
    and Glm5NextTextHyperConnection compute them: streams [T, hc, hidden] fp32, the block's fn [(2 + hc) * hc,
    hc * hidden], base [(2 + hc) * hc], scale [3] -> (post [T, hc], comb [T, hc, hc] Sinkhorn-normalized,
    the block's input [T, hidden]), fp32. The block's output then enters through `hyper_residual`."""
    hc = streams.shape[1]
    mixes = F.linear(unit_rms(streams.flatten(1), norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return post, comb, (pre[:, :, None] * streams).sum(dim=1)


def hyper_block(config: Any, weights: dict[str, Tensor], prefix: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`hyper_connection` with the block's fn/base/scale under `prefix` (e.g. "layers.3.attn_hc.") and the
    config's hc_sinkhorn_iters, hc_eps and rms_norm_eps (DeepSeek-V4, glm5_next)."""
    c = config
    fn, base, scale = (weights[prefix + part] for part in ("fn", "base", "scale"))
    return hyper_connection(streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)


def hyper_residual(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor) -> Tensor:
    """The streams after a block: its output [T, hidden] expanded by post, plus comb^T mixing the input streams."""
    return post[:, :, None] * out[:, None, :] + torch.matmul(comb.transpose(-1, -2), streams)


class DecoderProgram(StepModule):
    """Pre-norm decoder: fused-QKV GQA attention over the flare:: paged-KV ops, then an MLP.
    Subclasses change `qk` (per-head transforms before RoPE) and `mlp`.
    """

    def qk(self, weights: dict[str, Tensor], layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q [T, H, D], k [T, KV, D] before RoPE; identity unless a family normalizes them."""
        return q, k

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        """SwiGLU over the fused gate/up projection: h [T, hidden] -> [T, hidden]."""
        return swiglu(weights, f"layers.{layer}.", h)

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        c = self.config
        # 16-bit cores: weights and matmul inputs in the core's dtype, but the residual stream,
        # norms and rotary stay fp32 (a bf16 residual through 30 layers moves logprobs by ~0.5).
        wdt = weights["embed"].dtype
        x = self.embed_tokens(weights, s.token_ids)
        cos, sin = rope(s.positions, c.head_dim, c.rope_theta, torch.float32)
        q_dim = c.num_heads * c.head_dim
        scale = 1.0 / math.sqrt(c.head_dim)
        for i in range(c.num_layers):
            h = rms_norm(x, weights[f"layers.{i}.attn_norm"], c.rms_norm_eps).to(wdt)
            q, k, v = F.linear(h, weights[f"layers.{i}.wqkv"]).float().split([q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = q.reshape(-1, c.num_heads, c.head_dim)
            k = k.reshape(-1, c.num_kv_heads, c.head_dim)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            q, k = self.qk(weights, i, q, k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = cached_attention(q, k, v, kv_cache[2 * i], kv_cache[2 * i + 1], s.paged, scale)
            # row-parallel o and MLP down projections on tp ranks: their partial sums meet here
            x = x + self.reduce(F.linear(attn.reshape(-1, q_dim).to(wdt), weights[f"layers.{i}.wo"]).float())
            h = rms_norm(x, weights[f"layers.{i}.mlp_norm"], c.rms_norm_eps).to(wdt)
            x = x + self.reduce(self.mlp(weights, i, h).float())
        x = rms_norm(x, weights["norm"], c.rms_norm_eps).to(wdt)
        return self.outputs(x, weights, s)


def swiglu(weights: dict[str, Tensor], p: str, h: Tensor) -> Tensor:
    """SwiGLU over the fused gate/up projection `p + "w_gate_up"` and `p + "w_down"`: h [T, hidden] -> [T, hidden]."""
    gate, up = F.linear(h, weights[p + "w_gate_up"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weights[p + "w_down"])


# ---------------------------------------------------------------------- plain reference

# (fp32 Hugging Face-named weights, layer prefix "model.layers.{i}.", normed h [T, hidden]) -> [T, hidden]
ReferenceMlp = Callable[[dict[str, Tensor], str, Tensor], Tensor]


def reference_swiglu(w: dict[str, Tensor], prefix: str, h: Tensor) -> Tensor:
    """A Hugging Face gate/up/down MLP under `prefix` (e.g. "model.layers.0.mlp.")."""
    gate, up = h @ w[prefix + "gate_proj.weight"].T, h @ w[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def reference_logits(
    config: DecoderFields, hf_weights: dict[str, Tensor], token_ids: list[int], mlp: ReferenceMlp, qk_norm: bool = False
) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights: logits [T, V] in fp32.

    Independent of the program path on purpose (no fused weights, no custom ops, explicit
    attention matrix), so the export self-check compares two implementations. With
    `qk_norm`, q and k get per-head RMSNorm (self_attn.q_norm / k_norm) before RoPE.
    """
    c = config
    w = {k: v.float() for k, v in hf_weights.items()}
    ids = torch.tensor(token_ids)
    total = len(token_ids)
    x = w["model.embed_tokens.weight"][ids]
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    angles = torch.arange(total, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()  # [T, D/2]

    def rotate(t: Tensor) -> Tensor:  # t [heads, T, D], rotary over (first half, second half) pairs
        a, b = t[..., : c.head_dim // 2], t[..., c.head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return weight * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def heads(t: Tensor, count: int, norm_weight: str | None) -> Tensor:  # [T, count*D] -> [count, T, D]
        t = t.view(total, count, c.head_dim)
        return (norm(t, w[norm_weight]) if norm_weight else t).transpose(0, 1)

    mask = torch.full((total, total), float("-inf")).triu(1)
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = heads(
            h @ w[p + "self_attn.q_proj.weight"].T, c.num_heads, p + "self_attn.q_norm.weight" if qk_norm else None
        )
        k = heads(
            h @ w[p + "self_attn.k_proj.weight"].T, c.num_kv_heads, p + "self_attn.k_norm.weight" if qk_norm else None
        )
        v = heads(h @ w[p + "self_attn.v_proj.weight"].T, c.num_kv_heads, None)
        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(c.head_dim) + mask
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + mlp(w, p, h)
    x = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def attention_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """Per-layer norm and attention projection shapes (names under "model.layers.{i}.")."""
    q, kv, h = c.num_heads * c.head_dim, c.kv_dim, c.hidden_size
    return {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
    }


def tiny_decoder_config(architecture: str, model_type: str, vocab_size: int) -> dict[str, Any]:
    """The Llama-shaped test config.json the dense families' tiny checkpoints start from: 2 layers of 4
    query and 2 kv heads of 16, hidden size 64, MLP width 128, untied, float32."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def swiglu_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """A Hugging Face gate/up/down MLP's tensor shapes under `prefix` (e.g. "mlp.", "mlp.shared_experts.")."""
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def qk_norm_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """Per-layer q/k norm shapes (names under "model.layers.{i}.")."""
    return {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}


def decoder_shapes(c: Any, per_layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes: embedding, final norm, head unless tied, and
    `per_layer` (names under "model.layers.{i}.") for every layer, in that order."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for layer in range(c.num_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes
