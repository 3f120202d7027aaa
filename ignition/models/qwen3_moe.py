"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3 attention with a sparse MoE MLP.

Each layer's MLP routes a token to `num_experts_per_tok` of `num_experts` SwiGLU experts:
router linear -> softmax over experts -> top-k -> optional renormalization
(norm_topk_prob) -> routing-weighted sum of the chosen experts' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ignition.models import common
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP, attention_shapes, decode_weight_bytes, decoder_shapes, kv_shape, reference_swiglu,
)  # fmt: skip  (kv_shape, decode_weight_bytes: the family interface, shared)
from ignition.models.qwen3 import QK_NORM_WEIGHT_MAP, attention_fields, qk_norm_shapes
from ignition.models.qwen3 import StepProgram as Qwen3StepProgram

FAMILY = "qwen3_moe"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
HF_MODEL_TYPES = ("qwen3_moe",)
GGUF_ARCHITECTURES: tuple[str, ...] = ()

# Hugging Face checkpoint name -> internal name; the second `{}` is the expert number.
# Experts stay one tensor per expert in the core: export's FUSED step concatenates per layer
# only, so stacking them into [E, ...] needs a per-family weight post-step in export.py.
WEIGHT_MAP = {
    **ATTENTION_WEIGHT_MAP,
    **QK_NORM_WEIGHT_MAP,
    "model.layers.{}.mlp.gate.weight": "layers.{}.w_router",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.experts.{}.w_gate",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.experts.{}.w_up",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.experts.{}.w_down",
}

# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
}


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int  # top-k experts per token, <= num_experts
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to one

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


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
        **attention_fields(hf, FAMILY),
    )


def routing_weights(config: Qwen3MoeConfig, router_logits: Tensor) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (top-k weights [T, K] fp32, expert ids [T, K])."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StepProgram(Qwen3StepProgram):
    """Qwen3's step with a sparse-MoE MLP, computed densely.

    Every expert runs on every token and is weighted by its routing weight (zero when not
    chosen): static shapes for any token count, so torch.export traces it simply. The cost
    is num_experts / num_experts_per_tok times the FLOPs of true routing and every expert's
    weights read each step; right for tiny test models, not for serving large MoE models
    (that wants stacked expert weights and a gather/grouped-matmul kernel).
    """

    def mlp(self, weights: dict[str, Tensor], layer: int, h: Tensor) -> Tensor:
        c = self.config
        top, ids = routing_weights(c, F.linear(h, weights[f"layers.{layer}.w_router"]))
        dense = torch.zeros(h.shape[0], c.num_experts, dtype=top.dtype, device=h.device)
        routing = dense.scatter(1, ids, top).to(h.dtype)  # [T, E], zero for experts not chosen
        out = torch.zeros_like(h)
        for e in range(c.num_experts):
            p = f"layers.{layer}.experts.{e}."
            gate, up = F.linear(h, weights[p + "w_gate"]), F.linear(h, weights[p + "w_up"])
            out = out + routing[:, e : e + 1] * F.linear(F.silu(gate) * up, weights[p + "w_down"])
        return out


def _reference_moe(config: Qwen3MoeConfig, w: dict[str, Tensor], prefix: str, h: Tensor) -> Tensor:
    """Sparse routing (only the chosen tokens go through each expert), unlike the program."""
    top, ids = torch.topk((h @ w[prefix + "mlp.gate.weight"].T).softmax(-1), config.num_experts_per_tok, dim=-1)
    if config.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(config.num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = reference_swiglu(w, f"{prefix}mlp.experts.{e}.", h[rows])
            out.index_add_(0, rows, y * top[rows, slots, None])
    return out


def reference_logits(config: Qwen3MoeConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """The shared plain-torch reference forward with q/k norms and a sparsely routed MoE."""
    mlp = lambda w, p, h: _reference_moe(config, w, p, h)  # noqa: E731
    return common.reference_logits(config, hf_weights, token_ids, mlp, qk_norm=True)


# ----------------------------------------------------------------------- test checkpoints

# Test checkpoints carry Qwen3's own special tokens and published template (testmodel.CHATS).
TEST_CHAT: str | None = "qwen3"


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints (untied, like Qwen3-30B-A3B)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
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
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def hf_shapes(c: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    h, f = c.hidden_size, c.moe_intermediate_size
    moe: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        moe.update({f"mlp.experts.{e}.gate_proj.weight": (f, h), f"mlp.experts.{e}.up_proj.weight": (f, h),
                    f"mlp.experts.{e}.down_proj.weight": (h, f)})  # fmt: skip
    return decoder_shapes(c, {**attention_shapes(c), **qk_norm_shapes(c), **moe})
