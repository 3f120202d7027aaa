"""The Qwen3 dense family (Qwen3ForCausalLM): config, weight maps, step program, reference.

Llama's decoder plus a per-head RMSNorm on q and k (weights of size head_dim, applied
before RoPE), head_dim read from the config, and optionally tied embeddings.
No GGUF reading yet (its Family has no gguf reader).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor

from ignition.models import common
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP,
    DENSE_FUSED,
    QK_NORM_WEIGHT_MAP,
    SWIGLU_WEIGHT_MAP,
    DecoderProgram,
    DenseConfig,
    attention_shapes,
    decoder_fields,
    decoder_shapes,
    qk_norm_shapes,
    reference_swiglu,
    rms_norm,
    swiglu_shapes,
    tiny_decoder_config,
)
from ignition.models.family import Family, Reference, TinyCheckpoint

NAME = "qwen3"
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
HF_MODEL_TYPES = ("qwen3",)

# Hugging Face checkpoint name -> internal name: Llama's, plus the per-head q/k norms.
WEIGHT_MAP = {**ATTENTION_WEIGHT_MAP, **QK_NORM_WEIGHT_MAP, **SWIGLU_WEIGHT_MAP}
FUSED = DENSE_FUSED

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
    return (
        tiny_decoder_config("Qwen3ForCausalLM", "qwen3", vocab_size) | TINY_QWEN3_FIELDS | {"tie_word_embeddings": True}
    )


# What the Qwen3 families' tiny configs add to common.tiny_decoder_config.
TINY_QWEN3_FIELDS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}


def hf_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    mlp = swiglu_shapes("mlp.", c.hidden_size, c.intermediate_size)
    return decoder_shapes(c, {**attention_shapes(c), **qk_norm_shapes(c), **mlp})


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT),
)
