"""Recurrent-state ops shared by the hybrid families (Mamba-2, gated DeltaNet): the state
convention every such op follows, and the depthwise causal convolution both use.

State convention (helios.core.program): a state pool is [num_slots, *shape], updated in
place. Sequence b's tokens are the rows query_start_loc[b]:query_start_loc[b+1], at
contiguous increasing positions. If its first position is 0 it starts from zero state and
its slot's contents are ignored; otherwise pool[state_slots[b]] holds the state after all
of its earlier tokens. The op leaves the state after the sequence's last row there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.fakes import like_first


class Span(NamedTuple):
    """One sequence's rows in a step and where its state lives."""

    start: int
    end: int
    slot: int
    fresh: bool  # starts at position 0: zero state


def state_spans(state_slots: Tensor, query_start_loc: Tensor, positions: Tensor) -> list[Span]:
    """Each sequence's rows, slot and whether it starts fresh (the state convention above)."""
    starts = query_start_loc.tolist()
    slots = state_slots.tolist()
    spans = []
    for b, slot in enumerate(slots):
        start, end = starts[b], starts[b + 1]
        fresh = end > start and int(positions[start]) == 0
        spans.append(Span(start, end, slot, fresh))
    return spans


@torch.library.custom_op("flare::causal_conv1d", mutates_args=("conv_state",))
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    conv_state: Tensor,
    state_slots: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    silu: bool,
) -> Tensor:
    """Depthwise causal convolution over each sequence's tokens, carrying its input window.

    x:          [T, C] this step's inputs, sequences concatenated
    weight:     [C, K] (Hugging Face's Conv1d weight [C, 1, K] squeezed)
    bias:       [C] (zeros for a model without one)
    conv_state: [S, C, K - 1] the last K - 1 inputs of each slot's sequence, oldest first
    returns     [T, C]: y[t, c] = act(bias[c] + sum_k weight[c, k] * window[t + k, c]), where the
                window is the sequence's previous K - 1 inputs (zeros at position 0) then its rows;
                act is SiLU when `silu`. conv_state[slot] ends holding the last K - 1 window inputs.
    """
    out = torch.empty(x.shape, dtype=torch.float32)
    convolve_spans(x, weight, bias, conv_state, state_spans(state_slots, query_start_loc, positions), silu, out)
    return out.to(x.dtype)


def convolve_spans(
    x: Tensor, weight: Tensor, bias: Tensor, conv_state: Tensor, spans: list[Span], silu: bool, out: Tensor
) -> None:
    """causal_conv1d's arithmetic for the given sequences, one at a time, into `out` (fp32)."""
    width = weight.shape[1]
    w = weight.float()[:, None, :]
    for span in spans:
        rows = x[span.start : span.end].float().T  # [C, n]
        history = rows.new_zeros(x.shape[1], width - 1) if span.fresh else conv_state[span.slot].float()
        window = torch.cat([history, rows], dim=1)  # [C, K - 1 + n]
        y = F.conv1d(window[None], w, bias.float(), groups=x.shape[1])[0]  # [C, n]
        out[span.start : span.end] = (F.silu(y) if silu else y).T
        conv_state[span.slot] = window[:, window.shape[1] - (width - 1) :].to(conv_state.dtype)


causal_conv1d.register_fake(like_first)
