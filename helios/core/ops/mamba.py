"""`flare::mamba2_scan`: the Mamba-2 selective state-space scan (SSD) over recurrent state slots.

The program computes the mixer's projections and causal convolution; this op runs the scan
of each sequence's rows from its slot's state (the state convention of
helios.core.ops.recurrent) and leaves the state after its last row in the slot. The
reference kernel below is the plain per-token recurrence; helios registers a chunked one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.fakes import fp32_like_first
from helios.core.ops.recurrent import state_spans


def time_steps(dt: Tensor, dt_bias: Tensor, dt_min: float, dt_max: float) -> Tensor:
    """dt [T, H] raw -> softplus(dt + dt_bias) clamped to [dt_min, dt_max] (dt_max 0 = no upper bound), fp32."""
    steps = F.softplus(dt.float() + dt_bias.float())
    return steps.clamp(min=dt_min, max=dt_max) if dt_max > 0 else steps.clamp(min=dt_min)


@torch.library.custom_op("flare::mamba2_scan", mutates_args=("ssm_state",))
def mamba2_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    ssm_state: Tensor,
    state_slots: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    dt_min: float = 0.0,
    dt_max: float = 0.0,
) -> Tensor:
    """Each sequence's Mamba-2 scan, carrying its state across steps.

    x:               [T, H, P] the scan inputs (conv output), sequences concatenated
    dt:              [T, H] raw time steps (before dt_bias and softplus)
    A:               [H] fp32, negative (-exp(A_log))
    B, C:            [T, G, N] input and output projections, G groups of H / G consecutive heads
    D:               [H] skip weight
    dt_bias:         [H]
    ssm_state:       [S, H, P, N] fp32 pool; sequence b's state lives at state_slots[b]
    state_slots:     [B] int64; query_start_loc [B + 1] int32; positions [T] int64
    dt_min, dt_max:  the time steps are clamped to [dt_min, dt_max]; dt_max 0 = no upper bound
    returns          [T, H, P] fp32: with d_t = clamp(softplus(dt_t + dt_bias)),
                     h_t = exp(d_t * A) h_{t-1} + d_t * x_t B_t^T  (h_{-1} = 0 at position 0, else the slot),
                     y_t = h_t C_t + D * x_t; the slot ends holding h of the sequence's last row.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    steps = time_steps(dt, dt_bias, dt_min, dt_max)
    heads, groups = x.shape[1], B.shape[1]
    a = A.float()
    for span in state_spans(state_slots, query_start_loc, positions):
        if span.end <= span.start:
            continue
        fresh = torch.zeros(ssm_state.shape[1:], dtype=torch.float32, device=x.device)
        h = fresh if span.fresh else ssm_state[span.slot].float()
        for t in range(span.start, span.end):
            b = B[t].float().repeat_interleave(heads // groups, dim=0)  # [H, N]
            c = C[t].float().repeat_interleave(heads // groups, dim=0)
            d = steps[t]  # [H]
            h = h * torch.exp(d * a)[:, None, None] + (d[:, None] * x[t].float())[:, :, None] * b[:, None, :]
            out[t] = (h @ c[:, :, None])[:, :, 0] + D.float()[:, None] * x[t].float()
        ssm_state[span.slot] = h.to(ssm_state.dtype)
    return out


mamba2_scan.register_fake(fp32_like_first)
