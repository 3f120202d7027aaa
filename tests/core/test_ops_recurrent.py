"""flare::causal_conv1d: chunked, batched and decode calls reproduce one causal convolution
over each whole sequence (the form Hugging Face's Mamba-2 and gated DeltaNet layers run)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helios.core.ops.recurrent import state_spans
from helios.engine.kernels.recurrent import causal_conv1d_cpu

C, K = 6, 4


def whole(x, weight, bias, silu=True):
    """[n, C] -> [n, C]: Conv1d(padding=K-1) truncated to n, as the reference layers compute it."""
    y = F.conv1d(x.T[None], weight[:, None, :], bias, padding=K - 1, groups=C)[0, :, : x.shape[0]].T
    return F.silu(y) if silu else y


def run(kernel, pieces, conv_state, slots):
    """One step over sequences given as (x rows, first position)."""
    x = torch.cat([p for p, _ in pieces])
    starts = [0]
    positions = []
    for rows, first in pieces:
        starts.append(starts[-1] + rows.shape[0])
        positions += range(first, first + rows.shape[0])
    return kernel(
        x,
        WEIGHT,
        BIAS,
        conv_state,
        torch.tensor(slots),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(positions),
        True,
    )


torch.manual_seed(0)
WEIGHT, BIAS = torch.randn(C, K), torch.randn(C)
SEQS = [torch.randn(n, C) for n in (11, 3, 7)]


def test_spans_follow_the_state_convention():
    spans = state_spans(torch.tensor([4, 1]), torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 9]))
    assert [tuple(s) for s in spans] == [(0, 3, 4, True), (3, 4, 1, False)]


def test_chunks_and_decode_rows_equal_the_whole_sequence_convolution():
    expected = [whole(x, WEIGHT, BIAS) for x in SEQS]
    for kernel in (torch.ops.flare.causal_conv1d, causal_conv1d_cpu):
        state = torch.full((5, C, K - 1), 7.0)  # stale contents: fresh sequences must ignore them
        slots = [3, 0, 4]
        got = [[] for _ in SEQS]
        # step 1: prefill 5 / 3 / 2 tokens; step 2: the rest of seq 0 and 2 in chunks; then decode rows
        plan = [[(0, 0, 5), (1, 0, 3), (2, 0, 2)], [(0, 5, 9), (2, 2, 6)], [(0, 9, 10), (2, 6, 7)], [(0, 10, 11)]]
        for step in plan:
            out = run(kernel, [(SEQS[i][a:b], a) for i, a, b in step], state, [slots[i] for i, _, _ in step])
            offset = 0
            for i, a, b in step:
                got[i].append(out[offset : offset + b - a])
                offset += b - a
        for i, x in enumerate(expected):
            torch.testing.assert_close(torch.cat(got[i]), x, atol=1e-5, rtol=1e-5)
        # the window left behind is the last K-1 inputs
        torch.testing.assert_close(state[3], SEQS[0][-(K - 1) :].T)
