"""The Qwen3 dense family (Qwen3ForCausalLM): config, weight maps, step program, reference.

Llama's decoder plus a per-head RMSNorm on q and k (weights of size head_dim, applied
before RoPE), head_dim read from the config, and optionally tied embeddings.
No GGUF reading yet (its Family has no gguf reader).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ignition.models import common
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP,
    DecoderProgram,
    DenseConfig,
    attention_shapes,
    decode_weight_bytes,
    decoder_fields,
    decoder_shapes,
    kv_shape,
    reference_swiglu,
    rms_norm,
)
from ignition.models.family import Family, Reference, TinyCheckpoint

NAME = "qwen3"
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
HF_MODEL_TYPES = ("qwen3",)

# The per-head q/k norms Qwen3 adds to Llama's attention (Hugging Face name -> internal name).
QK_NORM_WEIGHT_MAP = {
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.q_norm",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.k_norm",
}

# Hugging Face checkpoint name -> internal name (stored in the core's safetensors).
WEIGHT_MAP = {
    **ATTENTION_WEIGHT_MAP,
    **QK_NORM_WEIGHT_MAP,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
}

# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}

Qwen3Config = DenseConfig


def check_attention(hf: dict[str, Any], family: str) -> None:
    """Reject Qwen3 attention variants the shared program does not compute."""
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias is not supported by the {family} family")
    if hf.get("use_sliding_window"):
        raise ValueError(f"sliding-window attention is not supported by the {family} family")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported by the {family} family")


def attention_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The config fields every Qwen3 family shares (everything but the MLP sizes)."""
    check_attention(hf, family)
    return decoder_fields(hf, family, 32768)


def config_from_hf(hf: dict[str, Any]) -> Qwen3Config:
    """Read a Hugging Face config.json dict; unsupported variants raise ValueError."""
    return Qwen3Config(intermediate_size=int(hf["intermediate_size"]), **attention_fields(hf, NAME))


class StepProgram(DecoderProgram):
    """Qwen3's step: the shared decoder with per-head q/k RMSNorm before RoPE."""

    def qk(self, weights: dict[str, Tensor], layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        eps = self.config.rms_norm_eps
        return rms_norm(q, weights[f"layers.{layer}.q_norm"], eps), rms_norm(k, weights[f"layers.{layer}.k_norm"], eps)


def reference_logits(config: Qwen3Config, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """The shared plain-torch reference forward with q/k norms and a dense SwiGLU MLP."""
    mlp = lambda w, p, h: reference_swiglu(w, p + "mlp.", h)  # noqa: E731
    return common.reference_logits(config, hf_weights, token_ids, mlp, qk_norm=True)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Qwen3's own special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "qwen3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints (tied, like Qwen3-0.6B)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def qk_norm_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """Per-layer q/k norm shapes (names under "model.layers.{i}.")."""
    return {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}


def hf_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    h, f = c.hidden_size, c.intermediate_size
    mlp = {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return decoder_shapes(c, {**attention_shapes(c), **qk_norm_shapes(c), **mlp})


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family(
    name=NAME,
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    weight_map=WEIGHT_MAP,
    fused=FUSED,
    kv_shape=kv_shape,
    decode_weight_bytes=decode_weight_bytes,
    step_program=StepProgram,
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(
        config=testmodel_config,
        hf_shapes=hf_shapes,
        chat=TEST_CHAT,
    ),
)
