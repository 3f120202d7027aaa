"""The step5 family: StepFun's Step 3.5/3.7 text architecture (transformers' Step3p7 text model).

What it computes, as transformers 5.24's modeling_step3p7 does (checked against its
Step3p7ForConditionalGeneration on the text path):
- Gemma-style RMSNorm `x * (1 + w)` (input, post-attention, final, and per-head q/k norms);
  embeddings unscaled; scores scaled by query_pre_attn_scalar**-0.5 (default head_dim).
- `layer_types`: "sliding_attention" layers see keys p - window < j <= p (the window passed to
  flare::paged_attention), "full_attention" layers are plainly causal. Text tokens get only
  these two causal masks: `use_bidirectional_attention` (off in the released configs) would
  make the prompt attend forwards, which an incremental KV cache cannot compute, so it is refused.
- Sliding layers have their own query-head count (`attention_other_setting` /
  num_sliding_attention_heads / per_layer_config); kv heads and head size are shared, so the
  paged cache is one uniform layout.
- Rotary per layer type: its own base and partial_rotary_factor (rotate-half over the first
  `rotary_dim` dims of a head, the rest passes through), and `rope_scaling` (llama3) on full
  layers only.
- A per-head sigmoid gate (`g_proj`, one scalar per head) multiplies the attention output
  before o_proj.
- MLPs: dense SwiGLU layers and sparse layers (`mlp_layer_types` / `moe_layers_enum`): sigmoid
  router, selection bias (`router_bias`), top-k renormalized weights scaled by
  moe_router_scaling_factor, plus an always-on shared expert. Gates and ups are clamped per
  layer (`silu_clamp_after`: min(silu(gate), L) * clamp(up, -L, L)): routed experts by
  `swiglu_limits`, the shared expert AND the dense MLP by `swiglu_limits_shared` (0 = none).
Tensors export leaves out: the multi-token-prediction layers past num_hidden_layers
(transformers ignores those too), and the vision tower and projector of a checkpoint that is
not multimodal. Multimodal checkpoints (a vision_config and a top-level image_token_id inside
the vocabulary, see _multimodal) export a vision program (step3p7_vision.py); the step
then takes image_features / image_rows and those rows' input embeddings are the features.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import moe, step3p7_config, step3p7_vision, vision_hooks
from ignition.models.common import DecoderProgram, offset_norm, theta_powers
from ignition.models.family import Family, PromptImages, Reference, TinyCheckpoint, TinyVision
from ignition.models.gemma3 import FULL, SLIDING
from ignition.models.step import Paged, StepInputs, cached_attention, embed_images
from ignition.models.step3p7_config import RopeSpec, Step3p7Config, canonical_name, ignored_tensor, window_pool
from ignition.models.vision_common import apply_rotary

# ---------------------------------------------------------------------------- step program


def inv_freq(spec: RopeSpec, like: Tensor) -> Tensor:
    """[dim / 2] fp32 inverse frequencies, llama3-scaled where the spec says (transformers' formula)."""
    inv = theta_powers(like, spec.dim, spec.theta)
    if not spec.llama3:
        return inv
    old = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _cos_sin(positions: Tensor, spec: RopeSpec) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq(spec, positions)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, dim]


def _activation(limit: float) -> moe.ExpertActivation:
    return moe.ExpertActivation("silu_clamp_after", limit)


class StepProgram(DecoderProgram):
    """Step 3.7's step over the flare:: paged-KV ops (see the module docstring)."""

    multimodal = True

    def attention(
        self,
        weights: dict[str, Tensor],
        i: int,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        kv_cache: list[Tensor],
        pages: Paged,
    ) -> Tensor:
        """h [T, hidden] in the core dtype -> the gated attention block's output [T, hidden] fp32."""
        c, p = self.config, f"layers.{i}."
        heads, kvh, hd, eps = c.layer_heads[i], c.num_kv_heads, c.head_dim, c.rms_norm_eps
        q, k, v, gate = F.linear(h, weights[p + "wqkvg"]).float().split([heads * hd, c.kv_dim, c.kv_dim, heads], dim=-1)
        cos, sin = rope
        q = apply_rotary(offset_norm(q.reshape(-1, heads, hd), weights[p + "q_norm"], eps), cos, sin)
        k = apply_rotary(offset_norm(k.reshape(-1, kvh, hd), weights[p + "k_norm"], eps), cos, sin)
        v = v.reshape(-1, kvh, hd)
        caches = kv_cache[2 * i], kv_cache[2 * i + 1]
        attn = cached_attention(q, k, v, *caches, pages, c.attention_scale, c.layer_windows[i], 0.0)
        attn = attn.float() * torch.sigmoid(gate)[:, :, None]  # one gate per head
        return F.linear(attn.reshape(-1, heads * hd).to(h.dtype), weights[p + "wo"]).float()

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        c, p = self.config, f"layers.{layer}."
        shared = _activation(c.shared_limits[layer])
        if not c.layer_sparse[layer]:  # the dense MLP clamps with the shared expert's limit, as transformers does
            return moe.shared_mlp(h, weights[p + "w_gate_up"], weights[p + "w_down"], shared)
        block = moe.MoeBlock(c.router, _activation(c.routed_limits[layer]), shared=True, shared_activation=shared)
        return moe.sparse_moe(block, weights, layer, h)

    def windowed(self) -> bool:
        return window_pool(self.config) is not None

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' input embeddings are the features (transformers' masked_scatter).
        Sliding layers' caches are in the window pool."""
        c = self.config
        eps = c.rms_norm_eps
        # As in the other families: weights and matmul inputs in the core's dtype, residual
        # stream, norms, rotary, gate and router in fp32.
        wdt = weights["embed"].dtype
        x = embed_images(F.embedding(s.token_ids, weights["embed"]).float(), s)
        ropes = {
            window > 0: _cos_sin(s.positions, c.rope_sliding if window else c.rope_full)
            for window in set(c.layer_windows)
        }
        for i, window in enumerate(c.layer_windows):
            h = offset_norm(x, weights[f"layers.{i}.attn_norm"], eps).to(wdt)
            x = x + self.attention(weights, i, h, ropes[window > 0], kv_cache, s.pages(window > 0))
            h = offset_norm(x, weights[f"layers.{i}.mlp_norm"], eps).to(wdt)
            x = x + self.mlp(weights, i, h).float()
        x = offset_norm(x, weights["norm"], eps).to(wdt)
        return self.outputs(x, weights, s)


# ---------------------------------------------------------------------- plain reference


def _reference_inv_freq(spec: RopeSpec) -> list[float]:
    """Inverse frequencies in plain Python floats (llama3's blend spelled out per frequency)."""
    out = []
    for j in range(0, spec.dim, 2):
        f = spec.theta ** (-j / spec.dim)
        if spec.llama3:
            old = spec.original_max_position_embeddings
            wavelen = 2 * math.pi / f
            if wavelen > old / spec.low_freq_factor:
                f = f / spec.factor
            elif wavelen >= old / spec.high_freq_factor:  # between the bounds: interpolate
                s = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
                f = (1 - s) * f / spec.factor + s * f
        out.append(f)
    return out


def reference_logits(
    config: Step3p7Config, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> Tensor:
    """Dense, unpaged forward over checkpoint-named weights in float64: logits [T, V] fp32.

    Independent of the program: unfused weights, explicit per-layer masks, rotary as complex
    rotations, routing by sorting and a loop over experts. The prompt's `images` replace their
    positions' input embeddings.
    """
    c = config
    f64 = torch.float64
    w = {canonical_name(k): v for k, v in hf_weights.items() if not ignored_tensor(c, k)}
    W = lambda name: w[name].to(f64)  # noqa: E731
    T = len(token_ids)
    pos = torch.arange(T, dtype=f64)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)].to(f64)
    if images is not None:
        images.splice(x)

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1.0 + weight)

    def rotate(t: Tensor, spec: RopeSpec) -> Tensor:  # t [heads, T, D]
        angles = pos[:, None] * torch.tensor(_reference_inv_freq(spec), dtype=f64)[None, :]
        half = spec.dim // 2
        z = torch.complex(t[..., :half], t[..., half : spec.dim]) * torch.polar(torch.ones_like(angles), angles)
        return torch.cat([z.real, z.imag, t[..., spec.dim :]], dim=-1)

    def act(gate: Tensor, up: Tensor, limit: float) -> Tensor:
        silu = gate / (1.0 + torch.exp(-gate))
        if limit > 0:
            silu, up = torch.minimum(silu, torch.tensor(limit, dtype=f64)), up.clamp(-limit, limit)
        return silu * up

    i_, j_ = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        heads, hd, window = c.layer_heads[i], c.head_dim, c.layer_windows[i]
        spec = c.rope_sliding if window else c.rope_full
        h = norm(x, W(p + "input_layernorm.weight"))
        q = norm((h @ W(a + "q_proj.weight").T).view(T, heads, hd), W(a + "q_norm.weight")).transpose(0, 1)
        k = norm((h @ W(a + "k_proj.weight").T).view(T, -1, hd), W(a + "k_norm.weight")).transpose(0, 1)
        v = (h @ W(a + "v_proj.weight").T).view(T, -1, hd).transpose(0, 1)
        q, k = rotate(q, spec), rotate(k, spec)
        group = heads // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        visible = (j_ <= i_) & ((j_ > i_ - window) if window else True)
        scores = (q @ k.transpose(1, 2)) * c.attention_scale
        attn = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [H, T, D]
        gate = 1.0 / (1.0 + torch.exp(-(h @ W(a + "g_proj.weight").T)))  # [T, H]
        attn = (attn.transpose(0, 1) * gate[:, :, None]).reshape(T, heads * hd)
        x = x + attn @ W(a + "o_proj.weight").T
        h = norm(x, W(p + "post_attention_layernorm.weight"))
        shared_limit = c.shared_limits[i]
        if not c.layer_sparse[i]:
            mlp = act(h @ W(p + "mlp.gate_proj.weight").T, h @ W(p + "mlp.up_proj.weight").T, shared_limit)
            x = x + mlp @ W(p + "mlp.down_proj.weight").T
            continue
        x = x + _reference_moe(c, W, set(w), p, h, lambda g, u: act(g, u, c.routed_limits[i]))  # noqa: B023 - called at once
        s = p + "share_expert."
        x = (
            x
            + act(h @ W(s + "gate_proj.weight").T, h @ W(s + "up_proj.weight").T, shared_limit)
            @ W(s + "down_proj.weight").T
        )
    x = norm(x, W("model.norm.weight"))
    head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"].to(f64)
    return (x @ head.T).float()


def _reference_moe(c: Step3p7Config, W, names: set[str], p: str, h: Tensor, act) -> Tensor:
    """The routed experts of one sparse layer (either expert layout), h [T, H] float64;
    act(gate, up) is the layer's clamped activation."""
    r = c.router
    scores = 1.0 / (1.0 + torch.exp(-(h @ W(p + "moe.gate.weight").T)))  # [T, E]
    ids = (scores + W(p + "moe.router_bias")).argsort(-1, descending=True)[:, : r.top_k]
    top = scores.gather(1, ids)
    top = top / top.sum(-1, keepdim=True) * r.routed_scaling_factor
    if p + "moe.gate_up_proj" in names:
        gate_w, up_w = W(p + "moe.gate_up_proj").chunk(2, dim=1)
    else:
        gate_w, up_w = W(p + "moe.gate_proj.weight"), W(p + "moe.up_proj.weight")
    down_w = W(p + "moe.down_proj.weight")
    out = torch.zeros_like(h)
    for e in range(r.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = act(h[rows] @ gate_w[e].T, h[rows] @ up_w[e].T) @ down_w[e].T
            out.index_add_(0, rows, y * top[rows, slots, None])
    return out


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Step-3.5-Flash's published template and tokens (testmodel.CHATS "step").
TEST_CHAT: str | None = "step"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Step 3.7 config in StepFun's own spellings (nested text_config, legacy per-layer
    lists padded with one MTP layer): full/sliding/sliding/full layers, window 8 (< a 16-token
    page), 4 query heads on full layers and 6 on sliding ones over 2 kv heads, partial rotary
    with llama3 scaling on full layers, one dense layer then three MoE layers of 8 experts
    (top 2, selection bias, scaling 2.5, a shared expert), clamps on some layers that bite."""
    text = {
        "model_type": "step3p5",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "share_expert_dim": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 16,
        "attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 2, "head_dim": 16},
        "layer_types": [FULL, SLIDING, SLIDING, FULL, FULL],
        "sliding_window": 8,
        "rope_theta": [5_000_000.0, 10_000.0, 10_000.0, 5_000_000.0, 5_000_000.0],
        "partial_rotary_factors": [0.5, 1.0, 1.0, 0.5, 0.5],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0,
            "high_freq_factor": 32.0,
        },
        "yarn_only_types": [FULL],
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "moe_router_scaling_factor": 2.5,
        "moe_layers_enum": "1,2,3,4",
        "swiglu_limits": [0.0, 0.0, 1.5, 0.0, 0.0],
        "swiglu_limits_shared": [1.5, 0.0, 0.0, 2.0, 0.0],
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    vision = {"width": 16, "layers": 1, "heads": 2, "image_size": 28, "patch_size": 14, "max_position_embeddings": 4}
    return {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "text_config": text,
        "vision_config": vision,
        "max_position_embeddings": 4096,  # also at the top, where testmodel reads the tokenizer's length
        "torch_dtype": "float32",
    }


def _layer_shapes(c: Step3p7Config, i: int) -> dict[str, tuple[int, ...]]:
    h, hd, heads, kv = c.hidden_size, c.head_dim, c.layer_heads[min(i, c.num_layers - 1)], c.kv_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, heads * hd),
        "self_attn.g_proj.weight": (heads, h),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }
    if i < c.num_layers and not c.layer_sparse[i]:
        f = c.intermediate_size
        return shapes | {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    e, f, s = c.router.num_experts, c.moe_intermediate_size, c.share_expert_dim
    return shapes | {
        "moe.gate.weight": (e, h),
        "moe.router_bias": (e,),
        "moe.gate_proj.weight": (e, f, h),
        "moe.up_proj.weight": (e, f, h),
        "moe.down_proj.weight": (e, h, f),
        "share_expert.gate_proj.weight": (s, h),
        "share_expert.up_proj.weight": (s, h),
        "share_expert.down_proj.weight": (h, s),
    }


def hf_shapes(c: Step3p7Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (StepFun's layout) and shapes, MTP layers included (a decoder
    layer plus its eh_proj / enorm / hnorm, as Step's checkpoints append them); a multimodal
    config's vision tower and projector in transformers' layout."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers + c.num_mtp_layers):
        layer = _layer_shapes(c, i)
        if i >= c.num_layers:
            layer |= {"eh_proj.weight": (h, 2 * h), "enorm.weight": (h,), "hnorm.weight": (h,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    if c.vision is not None:
        shapes |= step3p7_vision.hf_shapes(c.vision)
    return shapes


# Test vision checkpoints: the "step" chat flavour plus the processor's framing tokens.
TESTMODEL_VISION_TOKENS = ("<im_patch>", *step3p7_vision.FRAMING)


def testmodel_vision(config: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """testmodel_config's checkpoint made multimodal: a 2-layer vision tower of width 32 (4 heads)
    over 14-pixel patches with a 12 x 12 position grid (a 168-pixel global view, 9 tokens; 112-pixel
    tiles, 4 tokens each, whose positions are interpolated), projector with a bias, and the
    tokenizer's <im_patch> as image_token_id. `tokens`: TESTMODEL_VISION_TOKENS -> ids."""
    vision = {
        "width": 32,
        "layers": 2,
        "heads": 4,
        "image_size": 168,
        "patch_size": 14,
        "mlp_ratio": 2.0,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
        "ls_init_value": 0.5,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    return config | {"vision_config": vision, "image_token_id": tokens["<im_patch>"], "projector_bias": True}


# Step3p7ImageProcessor settings of the tiny vision checkpoints (preprocessor_config.json).
TESTMODEL_PROCESSOR = {
    "image_processor_type": "Step3p7ImageProcessor",
    "size": {"height": 168, "width": 168},
    "patch_size": 112,
    "max_image_size": 448,
}


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, "step5-vision", TESTMODEL_VISION_TOKENS, TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    step3p7_config,
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(step3p7_vision)),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT, vision=TINY_VISION),
    vision=vision_hooks.of(step3p7_vision),
)
