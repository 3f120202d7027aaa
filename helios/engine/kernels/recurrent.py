"""helios' CPU kernel for flare::causal_conv1d (helios.core.ops.recurrent): the same
arithmetic as the reference, with every decode row of a step (one token of a sequence
that already has state) convolved in one batched gather instead of a loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.recurrent import convolve_spans, state_spans


def causal_conv1d_cpu(x, weight, bias, conv_state, state_slots, query_start_loc, positions, silu) -> Tensor:
    """flare::causal_conv1d (arguments as its schema: helios.core.ops.recurrent)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    spans = state_spans(state_slots, query_start_loc, positions)
    decode = [s for s in spans if s.end - s.start == 1 and not s.fresh]
    if len(decode) > 1:
        rows = torch.tensor([s.start for s in decode])
        slots = torch.tensor([s.slot for s in decode])
        window = torch.cat([conv_state[slots].float(), x[rows].float()[:, :, None]], dim=2)  # [Bd, C, K]
        y = (window * weight.float()).sum(-1) + bias.float()
        out[rows] = F.silu(y) if silu else y
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
        spans = [s for s in spans if not (s.end - s.start == 1 and not s.fresh)]
    convolve_spans(x, weight, bias, conv_state, spans, silu, out)
    return out.to(x.dtype)


def register(library: torch.library.Library) -> None:
    library.impl("causal_conv1d", causal_conv1d_cpu, "CPU")
