"""helios' CPU kernel for flare::kda (helios.core.ops.glm5_next; the core's reference kernel steps
token by token in Python, one sequence at a time).

Decode rows (one token per sequence) take one recurrent step each, batched over their gathered
slots. Longer chunks use the chunked (WY / UT-transform) form, as transformers'
`chunk_kimi_delta_attention` computes it: within a chunk of up to CHUNK tokens the delta-rule
writes are condensed into unit-lower-triangular solves and a few matmuls, the per-channel
decays between two tokens of the chunk taken explicitly ([H, c, c, Dk], no exp(-cumsum)
factorization that could overflow without the gate's lower bound); chunks are scanned in
order. Same result as the recurrence up to fp32 rounding, for any chunking.

flare::kpool_topk keeps its reference kernel (vectorized per sequence already).
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.engine.kernels.gated_delta import DecodeRows, run_spans

CHUNK = 16  # tokens per chunk of the chunked form (its explicit decay tensor grows with CHUNK^2)
_IN_PLACE_BYTES = 1 << 18  # decode states of at least this many bytes per slot update in place


def kda_cpu(q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm):
    return run_spans(
        q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, (_chunk, CHUNK), _decode
    )


def _decode(d: DecodeRows, state: Tensor, out: Tensor) -> None:
    """One recurrent step for every one-token sequence: with D = diag(exp(g)), the decayed state's
    reads are S^T (D k) and S^T (D q), and o = (D S)'^T q = S^T (D q) + (k . q) delta (in place in
    large slots, as flare::gated_delta_rule's kernel does: DecodeRows)."""
    decay = d.g.exp()  # [Bd, H, Dk]
    if d.in_place(state, _IN_PLACE_BYTES):
        for i, row, s in d.slot_states(state):
            read = torch.bmm(s.transpose(-1, -2), torch.stack([decay[i] * d.k[i], decay[i] * d.q[i]], dim=-1))
            delta = (d.v[i] - read[..., 0]) * d.beta[i][:, None]
            out[row] = read[..., 1] + (d.k[i] * d.q[i]).sum(-1, keepdim=True) * delta
            s.mul_(decay[i][..., None]).baddbmm_(d.k[i][:, :, None], delta[:, None, :])
        return
    slots, s = d.gathered(state)
    read = s.transpose(-1, -2) @ torch.stack([decay * d.k, decay * d.q], dim=-1)  # [Bd, H, Dv, 2]
    delta = (d.v - read[..., 0]) * d.beta[..., None]
    out[d.rows] = read[..., 1] + (d.k * d.q).sum(-1, keepdim=True) * delta
    s = s * decay[..., None] + d.k[..., None] * delta[..., None, :]
    state.index_copy_(0, slots, s.to(state.dtype))


def _chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of c tokens per head: q, k [H, c, Dk], v [H, c, Dv], g [H, c, Dk], beta [H, c], s [H, Dk, Dv]."""
    c = q.shape[1]
    cum = g.cumsum(dim=1)  # [H, c, Dk] log decay from the chunk's start through each token
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    # decay[h, i, j, d] = exp(cum_i - cum_j) for j <= i (0 above the diagonal)
    decay = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = torch.einsum("hid,hjd,hijd->hij", k_beta, k, decay)
    system = system.masked_fill(~causal.tril(-1), 0.0)  # strictly lower; the solve's diagonal is one
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
    v_new = u - w @ s  # [H, c, Dv]: what each write adds beyond what the old state predicts
    attn = torch.einsum("hid,hjd,hijd->hij", q, k, decay)
    out = (q * cum.exp()) @ s + attn @ v_new
    last = cum[:, -1:, :]  # [H, 1, Dk]
    s = s * last.exp().transpose(1, 2) + (k * (last - cum).exp()).transpose(-1, -2) @ v_new
    return out, s


def register(library: torch.library.Library) -> None:
    """Install this kernel into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("kda", kda_cpu, "CPU")
