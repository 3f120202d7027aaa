"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3 attention with a sparse MoE MLP.

Each layer's MLP routes a token to `num_experts_per_tok` of `num_experts` SwiGLU experts:
router linear -> softmax over experts -> top-k -> optional renormalization
(norm_topk_prob) -> routing-weighted sum of the chosen experts' outputs, run by the
shared routed-MoE pieces in ignition.models.moe (only the chosen experts compute).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ignition.models import common, moe
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP,
    DENSE_FUSED,
    QK_NORM_WEIGHT_MAP,
    DecoderFields,
    attention_shapes,
    decoder_shapes,
    qk_norm_shapes,
    tiny_decoder_config,
)
from ignition.models.family import Family, Reference, TinyCheckpoint
from ignition.models.qwen3 import TINY_QWEN3_FIELDS, attention_fields
from ignition.models.qwen3 import StepProgram as Qwen3StepProgram

NAME = "qwen3_moe"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
HF_MODEL_TYPES = ("qwen3_moe",)

# Hugging Face checkpoint name -> internal name; the second `{}` is the expert number.
# Both expert layouts are read: per-expert tensors and transformers 5's stacked ones.
WEIGHT_MAP = {**ATTENTION_WEIGHT_MAP, **QK_NORM_WEIGHT_MAP, **moe.expert_weight_map()}

# Per-expert tensors stacked into layers.{}.w_experts_gate_up [E, 2F, H] and w_experts_down [E, H, F].
STACKED = moe.STACKED_EXPERTS

# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
FUSED = {"layers.{}.wqkv": DENSE_FUSED["layers.{}.wqkv"]}


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig(DecoderFields):
    num_experts: int
    num_experts_per_tok: int  # top-k experts per token, <= num_experts
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to one

    @property
    def router(self) -> moe.RouterSpec:
        return moe.RouterSpec(self.num_experts, self.num_experts_per_tok, "softmax", self.norm_topk_prob)


def config_from_hf(hf: dict[str, Any]) -> Qwen3MoeConfig:
    """Read a Hugging Face config.json dict; unsupported variants raise ValueError.

    Only the all-sparse layout is supported: every layer an MoE layer
    (decoder_sparse_step 1, no mlp_only_layers), as in the published Qwen3-MoE models.
    """
    step = int(hf.get("decoder_sparse_step", 1))
    dense_layers = list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise ValueError(
            f"only every-layer-sparse MoE is supported (got decoder_sparse_step {step}, mlp_only_layers {dense_layers})"
        )
    experts, top_k = int(hf["num_experts"]), int(hf["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    return Qwen3MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' default
        **attention_fields(hf, NAME),
    )


def decode_weight_bytes(config: Qwen3MoeConfig, weights: dict[str, Tensor]) -> int:
    """Weights one decode token reads: the shared ones plus its top-k experts per layer."""
    return moe.decode_weight_bytes(config, weights, config.num_experts_per_tok)


class StepProgram(Qwen3StepProgram):
    """Qwen3's step with a routed sparse-MoE MLP: only each token's top-k experts run."""

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        return moe.sparse_moe(moe.MoeBlock(self.config.router), weights, layer, h)


def reference_logits(config: Qwen3MoeConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """The shared plain-torch reference forward with q/k norms and a sparsely routed MoE
    (moe.reference_moe: its own routing and expert loop, not the program's op)."""
    mlp = lambda w, p, h: moe.reference_moe(moe.MoeBlock(config.router), w, p + "mlp.", h)  # noqa: E731
    return common.reference_logits(config, hf_weights, token_ids, mlp, qk_norm=True)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Qwen3's own special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "qwen3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints (untied, like Qwen3-30B-A3B)."""
    moe_fields = {
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return tiny_decoder_config("Qwen3MoeForCausalLM", "qwen3_moe", vocab_size) | TINY_QWEN3_FIELDS | moe_fields


def hf_shapes(c: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    h = c.hidden_size
    experts = moe.expert_shapes("mlp.", c.num_experts, h, c.moe_intermediate_size)
    return decoder_shapes(
        c, {**attention_shapes(c), **qk_norm_shapes(c), "mlp.gate.weight": (c.num_experts, h), **experts}
    )


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(testmodel_config, hf_shapes, TEST_CHAT),
)
