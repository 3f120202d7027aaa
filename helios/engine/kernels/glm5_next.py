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

from helios.engine.kernels.gated_delta import run_spans

CHUNK = 16  # tokens per chunk of the chunked form (its explicit decay tensor grows with CHUNK^2)
_IN_PLACE_BYTES = 1 << 18  # decode states of at least this many bytes per slot update in place


def kda_cpu(q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm):
    return run_spans(
        q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, chunked, _decode
    )


def _decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    decode: list[tuple[int, int, bool]],
    out: Tensor,
) -> None:
    """One recurrent step for every one-token sequence: with D = diag(exp(g)), the decayed state's
    reads are S^T (D k) and S^T (D q), and o = (D S)'^T q = S^T (D q) + (k . q) delta. Large states
    (real models: megabytes per slot) update in place in their slots, one sequence after another,
    as flare::gated_delta_rule's kernel does; small ones batch all rows in one gather."""
    rows = torch.tensor([r for r, _, _ in decode])
    slots = torch.tensor([s for _, s, _ in decode])
    qt, kt, vt, bt = q[rows], k[rows], v[rows], beta[rows]  # [Bd, H, D]
    decay = g[rows].exp()  # [Bd, H, Dk]
    if state[0].numel() * 4 >= _IN_PLACE_BYTES and state.dtype == torch.float32:
        for i, (row, slot, fresh) in enumerate(decode):
            s = state[slot]  # [H, Dk, Dv] view
            if fresh:
                s.zero_()
            read = torch.bmm(s.transpose(-1, -2), torch.stack([decay[i] * kt[i], decay[i] * qt[i]], dim=-1))
            delta = (vt[i] - read[..., 0]) * bt[i][:, None]
            out[row] = read[..., 1] + (kt[i] * qt[i]).sum(-1, keepdim=True) * delta
            s.mul_(decay[i][..., None]).baddbmm_(kt[i][:, :, None], delta[:, None, :])
        return
    s = state.index_select(0, slots).float()  # [Bd, H, Dk, Dv]
    fresh = [i for i, (_, _, f) in enumerate(decode) if f]
    if fresh:
        s[fresh] = 0.0
    read = s.transpose(-1, -2) @ torch.stack([decay * kt, decay * qt], dim=-1)  # [Bd, H, Dv, 2]
    delta = (vt - read[..., 0]) * bt[..., None]
    out[rows] = read[..., 1] + (kt * qt).sum(-1, keepdim=True) * delta
    s = s * decay[..., None] + kt[..., None] * delta[..., None, :]
    state.index_copy_(0, slots, s.to(state.dtype))


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """One sequence's rows: q, k [n, H, Dk] (prepared), v [n, H, Dv], g [n, H, Dk], beta [n, H],
    initial [H, Dk, Dv] or None (zero) -> (out [n, H, Dv], final state [H, Dk, Dv])."""
    n, heads, dk = k.shape
    s = q.new_zeros(heads, dk, v.shape[-1]) if initial is None else initial.clone()
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float32)
    qh, kh, vh, gh = (t.transpose(0, 1) for t in (q, k, v, g))  # [H, n, D]
    bh = beta.T  # [H, n]
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        o, s = _chunk(qh[:, start:end], kh[:, start:end], vh[:, start:end], gh[:, start:end], bh[:, start:end], s)
        out[start:end] = o.transpose(0, 1)
    return out, s


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
