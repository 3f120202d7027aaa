"""helios' quantized expert and embedding-row kernels as ops (`flare_quant::`), for compiled steps.

The portable step calls them as Python functions (helios.engine.quantized rewrites a quantized
core's expert calls to kernels.moe.routed_experts_quantized and its quantized embedding lookups
to quantized.embedding_rows). A step built ahead of time (ignition export --compile-step,
ignition.compiled) can call only registered ops, with fake kernels that give the output's shape
from the arguments alone (the packed blobs are constants whose bytes tracing cannot read): the
same kernels behind these two ops. Importing this module registers them; helios imports it
before it loads a compiled step, which finds them by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.engine import quantized
from helios.engine.kernels import moe


@torch.library.custom_op("flare_quant::routed_experts", mutates_args=())
def routed_experts(
    h: Tensor,
    expert_weights: Tensor,
    expert_ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str,
    limit: float,
    alpha: float,
    post_norm_scale: Tensor | None,
    post_norm_eps: float,
    dtype: torch.dtype,
    gate_up_features: int,
    down_features: int,
) -> Tensor:
    """moe.routed_experts_quantized (its arguments in its order): [num_tokens, hidden] fp32."""
    return moe.routed_experts_quantized(
        h,
        expert_weights,
        expert_ids,
        w_gate_up,
        w_down,
        activation,
        limit,
        alpha,
        post_norm_scale,
        post_norm_eps,
        dtype=dtype,
        gate_up_features=gate_up_features,
        down_features=down_features,
    )


@routed_experts.register_fake
def _routed_experts_fake(
    h: Tensor,
    expert_weights: Tensor,
    expert_ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str,
    limit: float,
    alpha: float,
    post_norm_scale: Tensor | None,
    post_norm_eps: float,
    dtype: torch.dtype,
    gate_up_features: int,
    down_features: int,
) -> Tensor:
    return h.new_empty((expert_ids.shape[0], h.shape[-1]), dtype=torch.float32)


@torch.library.custom_op("flare_quant::embedding_rows", mutates_args=())
def embedding_rows(packed: Tensor, ids: Tensor, dtype: torch.dtype, width: int) -> Tensor:
    """quantized.embedding_rows: the rows `ids` of a packed table of `width` inputs, [*ids, width]."""
    return quantized.embedding_rows(packed, ids, dtype)


@embedding_rows.register_fake
def _embedding_rows_fake(packed: Tensor, ids: Tensor, dtype: torch.dtype, width: int) -> Tensor:
    return ids.new_empty((*ids.shape, width), dtype=dtype)


# The overloads a compiled step's graph calls (ignition.compiled points the rewritten calls at them).
ROUTED_EXPERTS = torch.ops.flare_quant.routed_experts.default
EMBEDDING_ROWS = torch.ops.flare_quant.embedding_rows.default

__all__ = ["EMBEDDING_ROWS", "ROUTED_EXPERTS", "embedding_rows", "routed_experts"]
