"""The Gemma 4 text family (Gemma4ForCausalLM, model_type gemma4_text): config, weight maps, step program, reference.

What differs from Gemma 3 (ignition.models.gemma3), as transformers 5's modeling_gemma4 does it:
- RMSNorm multiplies by the weight itself (not 1 + w); values get a weightless RMSNorm too;
  attention scores are not scaled (scaling 1.0); each layer ends by multiplying the residual
  stream by its `layer_scalar`.
- Full-attention layers have their own head size (`global_head_dim`, default 512) and, with
  attention_k_eq_v, their own kv-head count (`num_global_key_value_heads`) and no v_proj: the
  values are the raw key projection (before k_norm and rotary).
- Rotary per layer type (`rope_parameters`): sliding layers `default`, full layers
  `proportional` (only the first partial_rotary_factor of the angles rotate).
- Per-layer input embeddings (PLE): a packed [vocab_per_layer, layers * P] table plus a projection
  of the input embedding give each layer a P-wide input, mixed in by a gated block after the MLP.
- KV sharing: the last num_kv_shared_layers layers compute no keys/values and attend over the
  cache of the last earlier layer of their type. Only the producing layers own cache tensors
  (kv_shape counts them); a shared layer calls paged_attention on its producer's cache and writes
  nothing. Shared layers' MLP is twice as wide with use_double_wide_mlp.
- The optional MoE block (enable_moe_block): a dense MLP and a routed GeLU-tanh expert block in
  parallel, each with its own norms; only each token's top-k experts run (flare::routed_experts,
  activation gelu_tanh).
The KV cache is one uniform layout: head size and kv heads are the largest over layers; smaller
layers are zero-padded in head size (q too, so scores are unchanged; output padding is dropped)
and repeat their kv heads to the cache's count (GQA grouping stays the same). Checked against
transformers' Gemma4ForCausalLM (eager attention).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import gemma4_config, gemma4_vision, moe, vision_hooks
from ignition.models.common import DecoderProgram, rotate_half, theta_powers
from ignition.models.family import Family, PromptImages, Reference, TinyCheckpoint, TinyVision
from ignition.models.gemma3 import FULL, SLIDING, embed_scale, softcapped
from ignition.models.gemma4_config import Gemma4Config, text_names, window_pool
from ignition.models.step import StepInputs
from ignition.models.vision_common import nested_testmodel

# ---------------------------------------------------------------------------- step program


def norm4(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Gemma 4's RMSNorm in fp32: x / rms(x) * w (the weight itself, unlike Gemma 3's 1 + w); no weight: unscaled."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return out * weight.float() if weight is not None else out


def _inv_freq(head_dim: int, theta: float, pairs: int, factor: float, like: Tensor) -> Tensor:
    """[head_dim / 2] fp32 inverse frequencies; angles past `pairs` are zero (proportional rotary)."""
    inv = theta_powers(like, head_dim, theta, pairs)
    if pairs < head_dim // 2:
        inv = torch.cat([inv, inv.new_zeros(head_dim // 2 - pairs)])
    return inv / factor


def _cos_sin(positions: Tensor, head_dim: int, rope: tuple[float, int, float]) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * _inv_freq(head_dim, *rope, like=positions)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


GELU_TANH = moe.ExpertActivation("gelu_tanh")


def host_embeddings(config: Gemma4Config) -> tuple[tuple[str, int | None], ...]:
    """export --host-embeddings: the per-layer input table (several GB in Gemma 4 E2B/E4B, which keep it
    off the accelerator) becomes host rows; image rows take the vision pad id's row, as the step does."""
    if not config.ple_dim:
        return ()
    return (("embed_per_layer", config.vision.pad_token_id if config.vision is not None else None),)


class StepProgram(DecoderProgram):
    """Gemma 4's step over the flare:: paged-KV ops."""

    multimodal = True

    def windowed(self) -> bool:
        return window_pool(self.config) is not None

    def bidirectional(self) -> bool:
        return self.images() and self.config.bidirectional_images

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        """Vision cores: the image rows' input embeddings are the features (unscaled, as transformers
        merges them) and their per-layer-input ids the pad id. Sliding layers' caches are in the window
        pool (window_pool). With bidirectional_images, sliding layers let an image's tokens see the
        rest of it (attention_until, flare::paged_attention_until)."""
        c = self.config
        eps = c.rms_norm_eps
        wdt = weights["embed"].dtype
        x = (F.embedding(s.token_ids, weights["embed"]) * embed_scale(c.hidden_size, wdt)).float()
        ple_ids = s.token_ids
        if s.image_features is not None and s.image_rows is not None:
            features, rows = s.image_features, s.image_rows
            T = x.shape[0]
            rows = torch.where(rows < 0, T, rows)  # unused rows land on a scratch row past the end
            x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_copy(0, rows, features.float())[:T]
            is_image = rows.new_zeros(T + 1, dtype=torch.bool).index_fill(0, rows, True)[:T]
            ple_ids = torch.where(is_image, c.vision.pad_token_id, s.token_ids)
        ple = None
        if c.ple_dim:
            # --host-embeddings: the runner gathered the table's rows (image rows: the pad id's) into host_rows.
            rows_of_ids = s.host_rows if s.host_rows is not None else F.embedding(ple_ids, weights["embed_per_layer"])
            tok = rows_of_ids * embed_scale(c.ple_dim, wdt)
            proj = F.linear(x.to(wdt), weights["per_layer_proj"]).float() * c.hidden_size**-0.5
            proj = norm4(proj.reshape(-1, c.num_layers, c.ple_dim), weights["per_layer_proj_norm"], eps)
            ple = (proj + tok.float().reshape(-1, c.num_layers, c.ple_dim)) * 2.0**-0.5
        ropes: dict[bool, tuple[Tensor, Tensor]] = {}
        for i, window in enumerate(c.layer_windows):
            hd, kvh, H = c.layer_head_dims[i], c.layer_kv_heads[i], c.num_heads
            if (window > 0) not in ropes:  # one head size per layer type (config_from_hf checks)
                ropes[window > 0] = _cos_sin(s.positions, hd, c.rope_sliding if window else c.rope_full)
            cos, sin = ropes[window > 0]
            p = f"layers.{i}."
            h = norm4(x, weights[p + "attn_norm"], eps).to(wdt)
            q = norm4(F.linear(h, weights[p + "wq"]).reshape(-1, H, hd), weights[p + "q_norm"], eps)
            q = q * cos + rotate_half(q) * sin
            src = c.kv_sources[i]
            k_cache, v_cache = kv_cache[2 * src], kv_cache[2 * src + 1]
            pages = s.pages(window > 0)
            kvt = k_cache.dtype
            if src == i:  # this layer produces keys and values
                k_raw = F.linear(h, weights[p + "wk"]).float().reshape(-1, kvh, hd)
                v_raw = k_raw if c.layer_k_eq_v[i] else F.linear(h, weights[p + "wv"]).float().reshape(-1, kvh, hd)
                k = norm4(k_raw, weights[p + "k_norm"], eps)
                k = k * cos + rotate_half(k) * sin
                v = norm4(v_raw, None, eps)
                k, v = self._to_cache(k), self._to_cache(v)
                torch.ops.flare.write_kv(k_cache, v_cache, k.to(kvt), v.to(kvt), pages.slot_mapping)
            if hd < c.head_dim:
                q = F.pad(q, (0, c.head_dim - hd))
            _, tables, seq_lens, query_start_loc, positions = pages
            if s.attention_until is not None and window > 0:
                attn = torch.ops.flare.paged_attention_until(
                    q.to(kvt),
                    k_cache,
                    v_cache,
                    tables,
                    seq_lens,
                    query_start_loc,
                    positions,
                    s.attention_until,
                    1.0,
                    window,
                    0.0,
                )
            else:
                attn = torch.ops.flare.paged_attention(
                    q.to(kvt), k_cache, v_cache, tables, seq_lens, query_start_loc, positions, 1.0, window, 0.0
                )
            attn = F.linear(attn[..., :hd].reshape(-1, H * hd).to(wdt), weights[p + "wo"])
            x = x + norm4(attn, weights[p + "post_attn_norm"], eps)
            h = norm4(x, weights[p + "mlp_norm"], eps).to(wdt)
            gate, up = F.linear(h, weights[p + "w_gate_up"]).float().chunk(2, dim=-1)
            mlp = F.linear((F.gelu(gate, approximate="tanh") * up).to(wdt), weights[p + "w_down"]).float()
            if c.num_experts:
                mlp = norm4(mlp, weights[p + "post_mlp_norm_1"], eps) + self._moe(weights, i, x)
            x = x + norm4(mlp, weights[p + "post_mlp_norm"], eps)
            if ple is not None:
                g = F.gelu(F.linear(x.to(wdt), weights[p + "ple_gate"]).float(), approximate="tanh") * ple[:, i, :]
                y = F.linear(g.to(wdt), weights[p + "ple_proj"])
                x = x + norm4(y, weights[p + "post_ple_norm"], eps)
            x = x * weights[p + "scalar"].float()
        x = norm4(x, weights["norm"], eps).to(wdt)
        return self.outputs(x, weights, s, c.final_softcap)

    def _to_cache(self, t: Tensor) -> Tensor:
        """[T, kvh, hd] -> [T, cache kv heads, cache head size]: repeat heads, zero-pad the size."""
        c = self.config
        if t.shape[1] < c.num_kv_heads:
            t = t.repeat_interleave(c.num_kv_heads // t.shape[1], dim=1)
        if t.shape[2] < c.head_dim:
            t = F.pad(t, (0, c.head_dim - t.shape[2]))
        return t

    def _moe(self, weights: dict[str, Tensor], i: int, x: Tensor) -> Tensor:
        """The MoE branch on the residual x [T, H] fp32 -> post-normed expert output [T, H] fp32."""
        c = self.config
        p = f"layers.{i}."
        eps = c.rms_norm_eps
        r = norm4(x, None, eps) * weights[p + "router_scale"].float() * c.hidden_size**-0.5
        probs = F.linear(r, weights[p + "w_router"].float()).softmax(dim=-1)
        top, ids = probs.topk(c.top_k_experts, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True) * weights[p + "expert_scale"].float()[ids]
        h2 = norm4(x, weights[p + "moe_norm"], eps).to(weights[p + "w_experts_gate_up"].dtype)
        out = moe.routed_mlp(h2, top, ids, weights[p + "w_experts_gate_up"], weights[p + "w_experts_down"], GELU_TANH)
        return norm4(out, weights[p + "post_moe_norm"], eps)


# ---------------------------------------------------------------------- plain reference


def reference_logits(
    config: Gemma4Config, hf_weights: dict[str, Tensor], token_ids: list[int], images: PromptImages | None = None
) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights in float64: logits [T, V] fp32.

    Independent of the program: unfused and unpadded weights, explicit per-layer masks, KV
    sharing by keeping each producer's keys/values, the MoE block as a loop over experts.
    The prompt's `images` replace their positions' input embeddings, whose per-layer-input token is
    the pad id (as transformers' Gemma4Model merges them).
    """
    c = config
    hf_weights = text_names(hf_weights)
    f64 = torch.float64
    w = lambda name: hf_weights[name].to(f64)
    T = len(token_ids)
    ids = torch.tensor(token_ids)
    table = hf_weights["model.embed_tokens.weight"]
    x = table[ids].to(f64) * embed_scale(c.hidden_size, table.dtype)
    image_positions = list(images.positions) if images is not None else []
    if image_positions:
        assert images is not None and c.vision is not None
        images.splice(x)
        ids = ids.clone()
        ids[torch.tensor(image_positions)] = c.vision.pad_token_id
    pos = torch.arange(T, dtype=f64)

    def norm(t: Tensor, weight: Tensor | None) -> Tensor:
        out = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        return out * weight if weight is not None else out

    def rotate(t: Tensor, hd: int, rope: tuple[float, int, float]) -> Tensor:  # t [heads, T, hd]
        theta, pairs, factor = rope
        inv = torch.zeros(hd // 2, dtype=f64)
        inv[:pairs] = 1.0 / theta ** (torch.arange(0, 2 * pairs, 2, dtype=f64) / hd)
        ang = pos[:, None] * (inv / factor)[None, :]
        cos, sin = ang.cos(), ang.sin()
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    runs = []  # bidirectional_images: each image's run of positions [s, e)
    if c.bidirectional_images and image_positions:
        from helios.core.program import image_runs

        runs = image_runs(image_positions)

    def mask(window: int) -> Tensor:
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal = j <= i
        if window > 0:  # transformers' sliding mask with images: AND(window, OR(causal, same image))
            for s, e in runs:
                causal = causal | ((i >= s) & (i < e) & (j >= s) & (j < e))
        visible = causal & ((j > i - window) if window > 0 else torch.ones(T, T, dtype=torch.bool))
        return torch.zeros(T, T, dtype=f64).masked_fill(~visible, float("-inf"))

    def gelu(t: Tensor) -> Tensor:
        return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t.pow(3))))

    ple = None
    if c.ple_dim:
        pt = hf_weights["model.embed_tokens_per_layer.weight"]
        tok = (pt[ids].to(f64) * embed_scale(c.ple_dim, pt.dtype)).view(T, c.num_layers, c.ple_dim)
        proj = (x @ w("model.per_layer_model_projection.weight").T) * c.hidden_size**-0.5
        proj = norm(proj.view(T, c.num_layers, c.ple_dim), w("model.per_layer_projection_norm.weight"))
        ple = (proj + tok) / math.sqrt(2.0)
    kv: dict[int, tuple[Tensor, Tensor]] = {}
    for i, window in enumerate(c.layer_windows):
        p = f"model.layers.{i}."
        hd, kvh, H = c.layer_head_dims[i], c.layer_kv_heads[i], c.num_heads
        rope = c.rope_sliding if window else c.rope_full
        h = norm(x, w(p + "input_layernorm.weight"))
        q = norm((h @ w(p + "self_attn.q_proj.weight").T).view(T, H, hd), w(p + "self_attn.q_norm.weight"))
        q = rotate(q.transpose(0, 1), hd, rope)
        if c.kv_sources[i] == i:
            k_raw = (h @ w(p + "self_attn.k_proj.weight").T).view(T, kvh, hd)
            v_raw = k_raw if c.layer_k_eq_v[i] else (h @ w(p + "self_attn.v_proj.weight").T).view(T, kvh, hd)
            k = rotate(norm(k_raw, w(p + "self_attn.k_norm.weight")).transpose(0, 1), hd, rope)
            kv[i] = (k, norm(v_raw, None).transpose(0, 1))
        k, v = kv[c.kv_sources[i]]
        group = H // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) + mask(window)  # no 1/sqrt(d): Gemma 4 scales by 1.0
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * hd)
        x = x + norm(attn @ w(p + "self_attn.o_proj.weight").T, w(p + "post_attention_layernorm.weight"))
        h = norm(x, w(p + "pre_feedforward_layernorm.weight"))
        mlp = (gelu(h @ w(p + "mlp.gate_proj.weight").T) * (h @ w(p + "mlp.up_proj.weight").T)) @ w(
            p + "mlp.down_proj.weight"
        ).T
        if c.num_experts:
            mlp = norm(mlp, w(p + "post_feedforward_layernorm_1.weight")) + _reference_moe(
                c, w, set(hf_weights), p, x, norm, gelu
            )
        x = x + norm(mlp, w(p + "post_feedforward_layernorm.weight"))
        if ple is not None:
            g = gelu(x @ w(p + "per_layer_input_gate.weight").T) * ple[:, i, :]
            x = x + norm(g @ w(p + "per_layer_projection.weight").T, w(p + "post_per_layer_input_norm.weight"))
        x = x * w(p + "layer_scalar")
    x = norm(x, w("model.norm.weight"))
    head = hf_weights["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    logits = torch.cat([x @ rows.to(f64).T for rows in head.split(1 << 15)], dim=-1)
    return softcapped(logits, c.final_softcap).float()


def _reference_moe(c: Gemma4Config, w, names: set[str], p: str, x: Tensor, norm, gelu) -> Tensor:
    """The MoE branch over HF names (stacked experts.gate_up_proj/down_proj or per-expert tensors)."""
    r = norm(x, None) * w(p + "router.scale") * c.hidden_size**-0.5
    logits = r @ w(p + "router.proj.weight").T
    e = (logits - logits.max(-1, keepdim=True).values).exp()
    probs = e / e.sum(-1, keepdim=True)
    ids = probs.argsort(-1, descending=True)[:, : c.top_k_experts]
    top = probs.gather(1, ids)
    top = top / top.sum(-1, keepdim=True) * w(p + "router.per_expert_scale")[ids]
    h = norm(x, w(p + "pre_feedforward_layernorm_2.weight"))
    out = torch.zeros_like(h)
    stacked = (p + "experts.gate_up_proj") in names
    for ex in range(c.num_experts):
        rows, slots = (ids == ex).nonzero(as_tuple=True)
        if not rows.numel():
            continue
        if stacked:
            gate, up = (h[rows] @ w(p + "experts.gate_up_proj")[ex].T).chunk(2, dim=-1)
            down = w(p + "experts.down_proj")[ex]
        else:
            gate = h[rows] @ w(f"{p}experts.{ex}.gate_proj.weight").T
            up = h[rows] @ w(f"{p}experts.{ex}.up_proj.weight").T
            down = w(f"{p}experts.{ex}.down_proj.weight")
        out.index_add_(0, rows, (gelu(gate) * up) @ down.T * top[rows, slots, None])
    return norm(out, w(p + "post_feedforward_layernorm_2.weight"))


# ----------------------------------------------------------------------- test checkpoints

# A compact Gemma 4-style chat template over its turn tokens (the published google/gemma-4-31B-it
# template, ../shared/templates/gemma4.jinja, also renders tools and thinking; cores take the
# checkpoint's own template, per the recipe).
CHAT_TEMPLATE = r"""{{ bos_token }}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<|turn>' + role + '\n' + (message['content'] | trim) + '<turn|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|turn>model\n' }}
{%- endif -%}
"""

TEST_CHAT: str | None = None
TEST_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
TEST_TOKEN_ROLES = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
TEST_CHAT_TEMPLATE = CHAT_TEMPLATE


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny gemma4_text config exercising the text features: window 8 (< a 16-token page),
    sliding/full layers with different head sizes and kv heads (global_head_dim 32,
    attention_k_eq_v with one global kv head), proportional rotary on full layers, per-layer
    inputs, the last two layers KV-shared with a double-wide MLP, final soft-capping, untied head."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 8,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "sliding_window": 8,
        "layer_types": [SLIDING, FULL, SLIDING, FULL],
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def testmodel_vision(text: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """A tiny multimodal (Gemma4ForConditionalGeneration) config around testmodel_config's text model:
    a 2-layer vision tower of width 32 over 4-pixel patches, 3 x 3 pooling, standardized features,
    up to 70 tokens per image (the reference processor's smallest max_soft_tokens). `tokens`: the
    tokenizer's ids of <|image|>, <|image> and <image|>."""
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 4,
        "pooling_kernel_size": 3,
        "position_embedding_size": 64,
        "standardize": True,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    return nested_testmodel(
        "Gemma4ForConditionalGeneration",
        "gemma4",
        text,
        vision,
        audio_config=None,
        image_token_id=tokens["<|image|>"],
        boi_token_id=tokens["<|image>"],
        eoi_token_id=tokens["<image|>"],
    )


TESTMODEL_PROCESSOR = {
    "image_processor_type": "Gemma4ImageProcessor",
    "patch_size": 4,
    "max_soft_tokens": 70,
    "pooling_kernel_size": 3,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": False,
    "do_convert_rgb": True,
}


def _text_shapes(c: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of the text model of a checkpoint with this config
    (hf_shapes nests them under model.language_model. beside a multimodal one's vision tower)."""
    h, H = c.hidden_size, c.num_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    if c.ple_dim:
        shapes |= {
            "model.embed_tokens_per_layer.weight": (c.ple_vocab, c.num_layers * c.ple_dim),
            "model.per_layer_model_projection.weight": (c.num_layers * c.ple_dim, h),
            "model.per_layer_projection_norm.weight": (c.ple_dim,),
        }
    for i in range(c.num_layers):
        p, hd, kv, f = (
            f"model.layers.{i}.",
            c.layer_head_dims[i],
            c.layer_kv_heads[i] * c.layer_head_dims[i],
            c.layer_intermediate[i],
        )
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "pre_feedforward_layernorm.weight": (h,),
            "post_feedforward_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (H * hd, h),
            "self_attn.o_proj.weight": (h, H * hd),
            "self_attn.q_norm.weight": (hd,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
            "layer_scalar": (1,),
        }
        if c.kv_sources[i] == i:
            layer |= {"self_attn.k_proj.weight": (kv, h), "self_attn.k_norm.weight": (hd,)}
            if not c.layer_k_eq_v[i]:
                layer["self_attn.v_proj.weight"] = (kv, h)
        if c.ple_dim:
            layer |= {
                "per_layer_input_gate.weight": (c.ple_dim, h),
                "per_layer_projection.weight": (h, c.ple_dim),
                "post_per_layer_input_norm.weight": (h,),
            }
        if c.num_experts:
            E, fe = c.num_experts, c.moe_intermediate_size
            layer |= {
                "router.proj.weight": (E, h),
                "router.scale": (h,),
                "router.per_expert_scale": (E,),
                "experts.gate_up_proj": (E, 2 * fe, h),
                "experts.down_proj": (E, h, fe),
                "post_feedforward_layernorm_1.weight": (h,),
                "post_feedforward_layernorm_2.weight": (h,),
                "pre_feedforward_layernorm_2.weight": (h,),
            }
        shapes |= {p + name: shape for name, shape in layer.items()}
    return shapes


hf_shapes = vision_hooks.nested_shapes(_text_shapes, gemma4_vision)


# The multimodal test checkpoint (ignition.testmodel --vision).
TINY_VISION = TinyVision(testmodel_vision, "gemma4-vision", ("<|image|>", "<|image>", "<image|>"), TESTMODEL_PROCESSOR)

# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    gemma4_config,
    sys.modules[__name__],
    reference=Reference(reference_logits, features=vision_hooks.reference_features(gemma4_vision)),
    tiny=TinyCheckpoint(
        testmodel_config,
        hf_shapes,
        TEST_CHAT,
        TEST_SPECIAL_TOKENS,
        TEST_TOKEN_ROLES,
        TEST_CHAT_TEMPLATE,
        vision=TINY_VISION,
    ),
    vision=vision_hooks.of(gemma4_vision, bidirectional=lambda config: config.bidirectional_images),
)
