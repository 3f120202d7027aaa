"""`flare::gated_delta_rule`: the gated delta rule (Gated DeltaNet linear attention) over
each sequence's tokens, carrying its recurrent state in a slot pool.

Per value head, with state S [Dk, Dv], for each token t in order:
    S <- S * exp(g_t)                                  (decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          (delta-rule write of the correction)
    o_t = S^T (scale * q_t)
with q_t, k_t L2-normalized first when `qk_l2norm` (eps 1e-6 inside the square root, as
transformers' `l2norm` and the flash-linear-attention kernels compute it). State slots follow
the recurrent-state convention of helios.core.program: a sequence starting at position 0
starts from zero state, any other reads its slot, and the slot ends holding the state after
the sequence's last row. The reference kernel below is the per-token recurrence in plain
torch; helios registers a chunked/batched one (helios.engine.kernels.gated_delta).
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.recurrent import Span, state_spans

L2NORM_EPS = 1e-6


def l2norm(x: Tensor) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (transformers' and FLA's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def prepare(q: Tensor, k: Tensor, v: Tensor, scale: float, qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 q (normalized and scaled), k (normalized), v, with q/k repeated to the value heads:
    [T, Hv, Dk], [T, Hv, Dk], [T, Hv, Dv]."""
    q, k, v = q.float(), k.float(), v.float()
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[1] // k.shape[1]
    if group > 1:  # value head h reads query/key head h // group
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q * scale, k, v


def delta_rule_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    state_slots: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    qk_l2norm: bool,
) -> Tensor:
    """The reference body of flare::gated_delta_rule and flare::kda (see the module docstrings):
    one schema, the gate's shape tells them apart.

    q, k:            [num_tokens, num_k_heads, k_dim] (any float dtype)
    v:               [num_tokens, num_v_heads, v_dim]; num_v_heads a multiple of num_k_heads,
                     value head h reads query/key head h // (num_v_heads / num_k_heads) (kda: equal)
    g:               log decay (<= 0) per token and head, [num_tokens, num_v_heads] (gated_delta_rule),
                     or per token, head and key channel, [num_tokens, num_heads, k_dim] (kda)
    beta:            [num_tokens, num_v_heads] write strength per token and head
    state:           [num_slots, num_v_heads, k_dim, v_dim] fp32 pool, updated in place
    state_slots:     [num_seqs] int64 slot of each sequence
    query_start_loc: [num_seqs + 1] int32 offsets of each sequence's rows
    positions:       [num_tokens] int64 (only each sequence's first position is read: 0 = fresh)
    scale:           multiplies q (after normalization); Qwen3-Next, GLM-5.3-Flash: k_dim ** -0.5
    qk_l2norm:       L2-normalize q and k per head first
    returns          [num_tokens, num_v_heads, v_dim] fp32
    """
    spans = state_spans(state_slots, query_start_loc, positions)
    return delta_rule(q, k, v, g, beta, state, spans, scale, qk_l2norm)


def delta_rule_fake(q, k, v, *_) -> Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)


gated_delta_rule = torch.library.custom_op("flare::gated_delta_rule", mutates_args=("state",))(delta_rule_op)
gated_delta_rule.register_fake(delta_rule_fake)


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, spans: list[Span], scale: float, norm: bool
) -> Tensor:
    """The per-token recurrence of flare::gated_delta_rule (g [T, Hv]: one decay per head) and of
    flare::kda (g [T, H, Dk]: one per key channel; g_t broadcasts over the state's trailing dims),
    over the sequences' spans (state_spans), with q and k L2-normalized first when `norm`."""
    q, k, v = prepare(q, k, v, scale, norm)
    g, beta = g.float(), beta.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for span in spans:
        if span.end <= span.start:
            continue
        slot = span.slot
        s = torch.zeros_like(state[slot]) if span.fresh else state[slot].float().clone()  # [H, Dk, Dv]
        for t in range(span.start, span.end):
            decay = g[t].exp()  # [H] or [H, Dk]
            s = s * decay.view(*decay.shape, *(1,) * (s.dim() - decay.dim()))
            predicted = torch.einsum("hkv,hk->hv", s, k[t])
            delta = (v[t] - predicted) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        state[slot] = s.to(state.dtype)
    return out
