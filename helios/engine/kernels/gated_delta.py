"""helios' CPU kernel for flare::gated_delta_rule (the core's reference kernel steps token by
token in Python, one sequence at a time).

Decode rows (one token per sequence) take one recurrent step each, in place in their slots
(batched over gathered slots where the states are small). Longer chunks use the chunked (WY /
UT-transform) form of the gated delta rule, as transformers' `torch_chunk_gated_delta_rule` and
flash-linear-attention compute it: within a chunk of up to CHUNK tokens, the delta-rule writes are condensed into
two unit-lower-triangular solves and a few matmuls; chunks are scanned in order. Same result
as the recurrence up to fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.gated_delta import prepare
from helios.core.ops.recurrent import state_spans

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)
_IN_PLACE_BYTES = 1 << 18  # decode states of at least this many bytes per slot update in place


def gated_delta_rule_cpu(q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm):
    return run_spans(
        q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, chunked, _decode
    )


def run_spans(
    q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, chunked_form, decode_form
) -> Tensor:
    """A delta-rule op over a batch's sequences: chunks of more than one token through
    `chunked_form(q, k, v, g, beta, initial_state) -> (out, final_state)`, one-token sequences
    together through `decode_form(q, k, v, g, beta, state, [(row, slot, fresh)], out)` (shared by
    gated DeltaNet and KDA, whose gates differ: per head, per key channel)."""
    q, k, v = prepare(q, k, v, scale, qk_l2norm)
    g, beta = g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    decode: list[tuple[int, int, bool]] = []  # (row, slot, fresh)
    for span in state_spans(state_slots, query_start_loc, positions):
        start, end = span.start, span.end
        if end - start == 1:
            decode.append((start, span.slot, span.fresh))
        elif end > start:
            initial = None if span.fresh else state[span.slot].float()
            o, final = chunked_form(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], initial)
            out[start:end] = o
            state[span.slot] = final.to(state.dtype)
    if decode:
        decode_form(q, k, v, g, beta, state, decode, out)
    return out


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
    """One recurrent step for every one-token sequence.

    The old state is read once for both S^T k and S^T q (one matmul), and
    o = S'^T q = exp(g) S^T q + (k . q) delta, so the updated state is not read again. Large
    states (real models: megabytes per slot, memory-bound) update in place in their slots, one
    sequence after another: gathering them into a batch and scattering back would add two more
    passes over them (measured 4x slower at 8 rows of 32 heads x 128 x 128). Small states batch
    all rows in one gather, where per-call overhead dominates.
    """
    rows = torch.tensor([r for r, _, _ in decode])
    qt, kt, vt, bt = q[rows], k[rows], v[rows], beta[rows]  # [Bd, Hv, D]
    decay = g[rows].exp()[..., None]  # [Bd, Hv, 1]
    qk = (kt * qt).sum(-1, keepdim=True)
    if state[0].numel() * 4 >= _IN_PLACE_BYTES and state.dtype == torch.float32:
        for i, (row, slot, fresh) in enumerate(decode):
            s = state[slot]  # [Hv, Dk, Dv] view
            if fresh:
                s.zero_()
            read = torch.bmm(s.transpose(-1, -2), torch.stack([kt[i], qt[i]], dim=-1))  # [Hv, Dv, 2]
            delta = (vt[i] - decay[i] * read[..., 0]) * bt[i][:, None]
            out[row] = decay[i] * read[..., 1] + qk[i] * delta
            s.mul_(decay[i][..., None]).baddbmm_(kt[i][:, :, None], delta[:, None, :])
        return
    slot_ids = torch.tensor([s for _, s, _ in decode])
    s = state.index_select(0, slot_ids).float()  # [Bd, Hv, Dk, Dv]
    fresh = [i for i, (_, _, f) in enumerate(decode) if f]
    if fresh:
        s[fresh] = 0.0
    read = s.transpose(-1, -2) @ torch.stack([kt, qt], dim=-1)  # [Bd, Hv, Dv, 2]: S^T k, S^T q
    delta = (vt - decay * read[..., 0]) * bt[..., None]
    out[rows] = decay * read[..., 1] + qk * delta
    s.mul_(decay[..., None]).add_(kt[..., None] * delta[..., None, :])
    state.index_copy_(0, slot_ids, s.to(state.dtype))


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """One sequence's rows in the chunked form: q, k [n, H, Dk] (prepared), v [n, H, Dv], g, beta
    [n, H], initial [H, Dk, Dv] or None (zero) -> (out [n, H, Dv], final state [H, Dk, Dv])."""
    n, heads, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(heads, dk, dv) if initial is None else initial.clone()
    out = torch.empty(n, heads, dv, dtype=torch.float32)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, D]
    gh, bh = g.T, beta.T  # [H, n]
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        o, s = _chunk(qh[:, start:end], kh[:, start:end], vh[:, start:end], gh[:, start:end], bh[:, start:end], s)
        out[start:end] = o.transpose(0, 1)
    return out, s


def _chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of c tokens per head: q, k [H, c, Dk], v [H, c, Dv], g, beta [H, c], s [H, Dk, Dv]."""
    c = q.shape[1]
    cum = g.cumsum(dim=-1)  # [H, c] log decay from the chunk's start through each token
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, c, c], i >= j
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly_lower(beta_i k_i . k_j decay_ij)) u = v_beta, and w for the decayed keys reading the old state
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    v_new = u - w @ s  # [H, c, Dv]: what each write adds beyond what the old state predicts
    attn = (q @ k.transpose(-1, -2)) * decay
    out = (q * cum.exp()[..., None]) @ s + attn @ v_new
    last = cum[:, -1:]  # [H, 1]
    s = s * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
    return out, s


def register(library: torch.library.Library) -> None:
    """Install this kernel into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("gated_delta_rule", gated_delta_rule_cpu, "CPU")
