"""The Llama family (Llama 2/3 dense, SmolLM2): config, weight maps, step program, reference.

The step program is written functionally over a weights dict so torch.export saves the
graph without weights; attention goes through the flare:: paged-KV ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models.heads import generation_outputs, prompt_outputs

FAMILY = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)
HF_MODEL_TYPES = ("llama",)
GGUF_ARCHITECTURES = ("llama",)

# Hugging Face checkpoint name -> internal name (stored in the core's safetensors).
WEIGHT_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.wq",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.wk",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.wv",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.wo",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
}

# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}

# GGUF tensor name -> Hugging Face name (llama.cpp's convert_hf_to_gguf naming).
GGUF_WEIGHT_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Read a Hugging Face config.json dict; unsupported variants raise ValueError."""
    scaling = hf.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {scaling!r} is not supported by the llama family yet")
    heads = int(hf["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Translate llama.cpp GGUF metadata into a Hugging Face style config dict."""
    arch = meta["general.architecture"]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def gguf_tensor_fixup(hf_name: str, tensor: Tensor, hf: dict[str, Any]) -> Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves for ggml's rope)."""
    if hf_name.endswith("q_proj.weight"):
        return _unpermute(tensor, int(hf["num_attention_heads"]))
    if hf_name.endswith("k_proj.weight"):
        return _unpermute(tensor, int(hf["num_key_value_heads"]))
    return tensor


def _unpermute(weight: Tensor, num_heads: int) -> Tensor:
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def kv_shape(config: LlamaConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the paged cache."""
    return config.num_layers, config.num_kv_heads, config.head_dim


def decode_weight_bytes(config: LlamaConfig, weights: dict[str, Tensor]) -> int:
    """Weights read per decode token: everything but the embedding table (one row is read),
    except when tied, where the table is the output projection and is read whole."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if "lm_head" in weights:
        total -= weights["embed"].numel() * weights["embed"].element_size()
    return total


# ---------------------------------------------------------------------------- step program


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class StepProgram(torch.nn.Module):
    """forward(weights, kv_cache, *inputs) per helios.core.program.program_signature."""

    def __init__(self, config: LlamaConfig, num_top: int, explicit_ids: bool, scored: bool) -> None:
        super().__init__()
        self.config = config
        self.num_top = num_top
        self.explicit_ids = explicit_ids
        self.scored = scored

    def forward(self, weights, kv_cache, token_ids, positions, slot_mapping, block_tables, seq_lens,
                query_start_loc, logits_indices, extra_1=None, extra_2=None):  # fmt: skip
        # The optional inputs follow program_signature's order: logprob_token_ids, then target_ids.
        extra = [t for t in (extra_1, extra_2) if t is not None]
        logprob_ids = extra.pop(0) if self.explicit_ids else None
        target_ids = extra.pop(0) if self.scored else None
        c = self.config
        x = F.embedding(token_ids, weights["embed"])
        cos, sin = _rope(positions, c.head_dim, c.rope_theta, x.dtype)
        q_dim = c.num_heads * c.head_dim
        scale = 1.0 / math.sqrt(c.head_dim)
        for i in range(c.num_layers):
            h = _rms_norm(x, weights[f"layers.{i}.attn_norm"], c.rms_norm_eps)
            q, k, v = F.linear(h, weights[f"layers.{i}.wqkv"]).split([q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = q.reshape(-1, c.num_heads, c.head_dim)
            k = k.reshape(-1, c.num_kv_heads, c.head_dim)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = kv_cache[2 * i], kv_cache[2 * i + 1]
            torch.ops.flare.write_kv(k_cache, v_cache, k, v, slot_mapping)
            attn = torch.ops.flare.paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale
            )
            x = x + F.linear(attn.reshape(-1, q_dim), weights[f"layers.{i}.wo"])
            h = _rms_norm(x, weights[f"layers.{i}.mlp_norm"], c.rms_norm_eps)
            gate, up = F.linear(h, weights[f"layers.{i}.w_gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, weights[f"layers.{i}.w_down"])
        x = _rms_norm(x, weights["norm"], c.rms_norm_eps)
        lm_head = weights["embed"] if c.tie_word_embeddings else weights["lm_head"]
        outputs = generation_outputs(x[logits_indices], lm_head, self.num_top, logprob_ids)
        if target_ids is not None:
            outputs += prompt_outputs(x, lm_head, target_ids, self.num_top)
        return tuple(outputs)


# ---------------------------------------------------------------------- plain reference


def reference_logits(config: LlamaConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """Dense, unpaged forward over Hugging Face-named weights: logits [T, V] in fp32.

    Independent of the program path on purpose (no fused weights, no custom ops, explicit
    attention matrix), so the export self-check compares two implementations.
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

    mask = torch.full((total, total), float("-inf")).triu(1)
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(total, c.num_heads, c.head_dim).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(total, c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(c.head_dim) + mask
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(total, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------- test checkpoints


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


# SmolLM2's control tokens (ids 0..16) and chat template, carried by test checkpoints.
TEST_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
)  # fmt: skip
TEST_TOKEN_ROLES = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    q, kv, h, f = c.num_heads * c.head_dim, c.kv_dim, c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }  # fmt: skip
    for layer in range(c.num_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes
