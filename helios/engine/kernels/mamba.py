"""helios' CPU kernel for flare::mamba2_scan (helios.core.ops.mamba): the same recurrence as the
reference, with every decode row of a step (one token of a sequence that already has state)
updated in one batched step, and longer spans run in the chunked (SSD) form: within a chunk
the outputs are one masked matrix product (no per-token loop), and the state passes from
chunk to chunk."""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.mamba import time_steps
from helios.core.ops.recurrent import state_spans

CHUNK = 64  # rows per SSD chunk: the [H, CHUNK, CHUNK] decay matrix stays small


def _decode(
    x: Tensor, steps: Tensor, a: Tensor, B: Tensor, C: Tensor, d: Tensor, states: Tensor
) -> tuple[Tensor, Tensor]:
    """One step for R rows at once: x [R, H, P], steps [R, H], B/C [R, G, N], states [R, H, P, N]
    -> (y [R, H, P], new states)."""
    rows, heads, dim = x.shape
    groups, n = B.shape[1], B.shape[2]
    per = heads // groups
    decay = torch.exp(steps * a)  # [R, H]
    xs = (steps[:, :, None] * x).view(rows, groups, per, dim, 1)
    states = states.view(rows, groups, per, dim, n) * decay.view(rows, groups, per, 1, 1)
    states = states + xs * B.view(rows, groups, 1, 1, n)
    y = (states @ C.view(rows, groups, 1, n, 1)).view(rows, heads, dim) + d[None, :, None] * x
    return y, states.view(rows, heads, dim, n)


def _chunked(
    x: Tensor, steps: Tensor, a: Tensor, B: Tensor, C: Tensor, d: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One sequence's rows in chunks: x [L, H, P], steps [L, H], B/C [L, G, N], state [H, P, N]
    -> (y [L, H, P], the state after the last row)."""
    length, heads, dim = x.shape
    groups, n = B.shape[1], B.shape[2]
    per = heads // groups
    out = torch.empty(x.shape, dtype=torch.float32)
    state = state.view(groups, per, dim, n)
    for start in range(0, length, CHUNK):
        end = min(start + CHUNK, length)
        size = end - start
        xc, dtc, bc, cc = x[start:end], steps[start:end], B[start:end], C[start:end]
        cum = (dtc * a).cumsum(0)  # [l, H]: log-decay from the chunk's start through each row
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        # decay[h, i, j] = exp(cum_i - cum_j) for j <= i (the product of the decays after row j through row i)
        decay = (cum.T[:, :, None] - cum.T[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, l, l]
        scores = torch.einsum("ign,jgn->gij", cc, bc)  # [G, l, l]: C_i . B_j
        mixing = scores[:, None] * decay.view(groups, per, size, size) * dtc.T.reshape(groups, per, 1, size)
        y = mixing.reshape(heads, size, size) @ xc.transpose(0, 1)  # [H, l, P]: within the chunk
        from_state = torch.einsum("ign,ghpn->ighp", cc, state).reshape(size, heads, dim)
        out[start:end] = y.transpose(0, 1) + from_state * cum.exp()[:, :, None] + d[None, :, None] * xc
        last = cum[-1]  # [H]
        weight = (torch.exp(last[None, :] - cum) * dtc).view(size, groups, per, 1) * xc.view(size, groups, per, dim)
        state = state * last.exp().view(groups, per, 1, 1) + torch.einsum("jghp,jgn->ghpn", weight, bc)
    return out, state.reshape(heads, dim, n)


def mamba2_scan_cpu(
    x, dt, A, B, C, D, dt_bias, ssm_state, state_slots, query_start_loc, positions, dt_min=0.0, dt_max=0.0
):
    x, B, C = x.float(), B.float(), C.float()
    a, d = A.float(), D.float()
    steps = time_steps(dt, dt_bias, dt_min, dt_max)
    out = torch.empty(x.shape, dtype=torch.float32)
    spans = state_spans(state_slots, query_start_loc, positions)
    decode = [s for s in spans if s.end - s.start == 1 and not s.fresh]
    if decode:
        rows = torch.tensor([s.start for s in decode])
        slots = torch.tensor([s.slot for s in decode])
        y, states = _decode(x[rows], steps[rows], a, B[rows], C[rows], d, ssm_state[slots].float())
        out[rows] = y
        ssm_state[slots] = states.to(ssm_state.dtype)
    for s in spans:
        if s.end - s.start > 1 or (s.end > s.start and s.fresh):
            state = torch.zeros(ssm_state.shape[1:], dtype=torch.float32) if s.fresh else ssm_state[s.slot].float()
            rows = slice(s.start, s.end)
            out[rows], state = _chunked(x[rows], steps[rows], a, B[rows], C[rows], d, state)
            ssm_state[s.slot] = state.to(ssm_state.dtype)
    return out


def register(library: torch.library.Library) -> None:
    library.impl("mamba2_scan", mamba2_scan_cpu, "CPU")
