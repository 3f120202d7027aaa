"""`flare::routed_experts`: the mixture-of-experts op exported step programs call.

Only the experts a token was routed to run on it: the program computes the routing
(weights and expert ids per token) and hands it here with the layer's stacked expert
weights. The reference CPU kernel below is plain torch; helios registers a faster one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.fakes import fp32_like_first

# The gated activations an expert may apply to its (gate, up) halves; `limit` 0 means no clamp.
# silu:              silu(min(gate, L)) * clamp(up, -L, L)         (SwiGLU; DeepSeek-V4 clamps)
# silu_clamp_after:  min(silu(gate), L) * clamp(up, -L, L)         (Step 3.7)
# clamped_glu:       g * sigmoid(alpha * g) * (clamp(up, -L, L) + 1), g = min(gate, L)   (MiniMax M3)
# gelu_tanh:         gelu(gate, tanh approximation) * up                  (Gemma 4)
# relu2:             relu(up)^2, ungated: w_gate_up holds only the up rows [F, H]   (Nemotron-H)
ACTIVATIONS = ("silu", "silu_clamp_after", "clamped_glu", "gelu_tanh", "relu2")


def expert_activation(gate_up: Tensor, activation: str, limit: float, alpha: float) -> Tensor:
    """An expert's activation over its first projection [rows, 2F] (gated) or [rows, F] (relu2) fp32."""
    if activation == "relu2":
        return torch.relu(gate_up).square()
    gate, up = gate_up.chunk(2, dim=-1)
    return gated_activation(gate, up, activation, limit, alpha)


def gated_activation(gate: Tensor, up: Tensor, activation: str, limit: float, alpha: float) -> Tensor:
    """One of ACTIVATIONS over fp32 halves [rows, F] -> [rows, F] fp32."""
    if activation == "silu":
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return F.silu(gate) * up
    if activation == "silu_clamp_after":
        act = F.silu(gate)
        if limit > 0:
            act, up = act.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return act * up
    if activation == "clamped_glu":
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1.0)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown expert activation {activation!r} (known: {', '.join(ACTIVATIONS)})")


def expert_forward(
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    limit: float = 0.0,
    alpha: float = 1.0,
    post_norm_scale: Tensor | None = None,
    post_norm_eps: float = 1e-6,
) -> Tensor:
    """One expert on its rows: x [n, H], w_gate_up [2F, H], w_down [H, F] -> [n, H] fp32.

    Matmul inputs are in the weights' dtype (as in the dense MLP); the activation and the
    result are fp32, so a 16-bit core sums its top-k expert outputs without rounding each.
    """
    wdt = w_gate_up.dtype
    act = expert_activation(F.linear(x.to(wdt), w_gate_up).float(), activation, limit, alpha)
    return post_expert_norm(F.linear(act.to(wdt), w_down).float(), post_norm_scale, post_norm_eps)


def post_expert_norm(y: Tensor, scale: Tensor | None, eps: float) -> Tensor:
    """Muse Spark's post-expert norm of an expert's fp32 output: scale first, then RMS-normalize
    (no norm: y as it is). Every expert kernel applies it through here."""
    if scale is None:
        return y
    y = y * scale.float()
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)


@torch.library.custom_op("flare::routed_experts", mutates_args=())
def routed_experts(
    h: Tensor,
    expert_weights: Tensor,
    expert_ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    limit: float = 0.0,
    alpha: float = 1.0,
    post_norm_scale: Tensor | None = None,
    post_norm_eps: float = 1e-6,
) -> Tensor:
    """Routing-weighted sum of each token's chosen gated-MLP experts.

    h:               [num_tokens, hidden] the MLP input (any float dtype)
    expert_weights:  [num_tokens, top_k] fp32 routing weight of each chosen expert
    expert_ids:      [num_tokens, top_k] int64 chosen experts, each in [0, num_experts)
    w_gate_up:       [num_experts, 2 * F, hidden] gate rows [0, F), up rows [F, 2F) ([num_experts, F, hidden] ungated)
    w_down:          [num_experts, hidden, F]
    activation, limit, alpha: the gated activation (ACTIVATIONS); limit 0 = no clamp
    post_norm_scale: [hidden] or None; when given each expert's output is scaled by it and
                     RMS-normalized (eps post_norm_eps) before its routing weight applies
    returns          [num_tokens, hidden] fp32
    """
    num_tokens, top_k = expert_ids.shape
    out = torch.zeros(num_tokens, h.shape[-1], dtype=torch.float32, device=h.device)
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // top_k  # the token of each sorted assignment
    weights = expert_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        group = rows[start : start + count]
        y = expert_forward(
            h[group], w_gate_up[expert], w_down[expert], activation, limit, alpha, post_norm_scale, post_norm_eps
        )
        out.index_add_(0, group, y * weights[start : start + count, None])
        start += count
    return out


routed_experts.register_fake(fp32_like_first)


# The plain-torch body of the op, callable without the dispatcher (helios' kernel hands it the
# post-norm case): sort the token->expert assignments by expert, run each chosen expert once on
# its contiguous group of rows, scale by the routing weights, add back per token.
reference_routed_experts = routed_experts._init_fn
