"""flare::routed_experts' Triton kernel (helios.engine.cuda.moe) under Triton's interpreter against
the core's reference (helios.core.ops.moe): every activation with and without its clamp, the
post-expert norm, fp32 (tight) and bf16 weights, decode rows and batches (both row-block sizes),
experts with no rows, ragged expert loads, strided weights; and capturability (no host reads)."""

from __future__ import annotations

import pytest
import torch

import tests.cuda.interpreter_fixes  # noqa: F401  (the interpreter computes as a GPU does)
from helios.core.ops.moe import ACTIVATIONS, reference_routed_experts
from helios.engine.cuda import moe
from tests.cuda.paged_steps import no_host_reads

HIDDEN, FFN, EXPERTS, TOP_K = 24, 20, 5, 2  # not multiples of the kernels' blocks
# (rtol, atol relative to the output's largest magnitude) per weight dtype: fp32 accumulates in
# IEEE fp32 like the reference; bf16 rounds both matmul outputs to bf16 as the reference does, and
# a different summation order can flip one rounding (about 2^-8 of an intermediate value).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 5e-3)}
# (limit, alpha) per activation: the clamped variants as their families configure them
CLAMPS = {"silu": (7.0, 1.0), "silu_clamp_after": (7.0, 1.0), "clamped_glu": (7.0, 1.702)}


def _inputs(tokens: int, dtype: torch.dtype, activation: str, seed: int, experts: int = EXPERTS):
    gen = torch.Generator().manual_seed(seed)
    rows = FFN if activation == "relu2" else 2 * FFN
    h = torch.randn(tokens, HIDDEN, generator=gen)
    w_gate_up = (torch.randn(experts, rows, HIDDEN, generator=gen) * 0.6).to(dtype)
    w_down = (torch.randn(experts, HIDDEN, FFN, generator=gen) * 0.3).to(dtype)
    # skewed routing: expert 0 takes many rows, the last expert none (ragged loads, an empty expert)
    scores = torch.rand(tokens, experts, generator=gen) + torch.linspace(0.6, 0.0, experts)
    scores[:, -1] = -1.0
    weights, ids = scores.topk(TOP_K, dim=-1)
    return h, weights.softmax(-1), ids, w_gate_up, w_down


def _check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_matches_the_reference(activation: str, dtype: torch.dtype) -> None:
    """Decode (one token) and a batch; clamped where the activation has a clamp."""
    for tokens, (limit, alpha) in ((1, (0.0, 1.0)), (9, CLAMPS.get(activation, (0.0, 1.0)))):
        args = _inputs(tokens, dtype, activation, ACTIVATIONS.index(activation) * 10 + tokens)
        expected = reference_routed_experts(*args, activation, limit, alpha)
        with no_host_reads():
            got = moe.routed_experts(*args, activation, limit, alpha)
        _check(got, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wide_row_blocks_post_norm_and_strided_weights(dtype: torch.dtype) -> None:
    """Enough assignments per expert for the 64-row blocks; Muse Spark's post-expert norm; a
    down matrix stored transposed (a strided view); bf16 activations, rows strided, into fp32 weights."""
    h, weights, ids, w_gate_up, w_down = _inputs(40, dtype, "silu", 3, experts=4)
    assert moe._blocks(ids.numel(), 4, dtype)[0] == 64
    scale = torch.rand(HIDDEN) + 0.5
    expected = reference_routed_experts(h, weights, ids, w_gate_up, w_down, "silu", 0.0, 1.0, scale, 1e-5)
    with no_host_reads():
        got = moe.routed_experts(h, weights, ids, w_gate_up, w_down, "silu", 0.0, 1.0, scale, 1e-5)
    _check(got, expected, dtype)
    strided = w_down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    h_rows = torch.cat([h, h[:, :3]], dim=1).bfloat16()[:, 3:]  # h as a slice of wider rows
    expected = reference_routed_experts(h_rows, weights, ids, w_gate_up, strided)
    _check(moe.routed_experts(h_rows, weights, ids, w_gate_up, strided), expected, dtype)


def test_alignment_groups_every_assignment_by_expert() -> None:
    """Each assignment appears once, in its expert's blocks, in order; the rest is padding."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    sorted_ids, block_experts = moe.align_by_expert(ids, 6, 4)
    assert sorted_ids.numel() == 4 * block_experts.numel()
    assert block_experts.numel() == (10 + 5 * 3 + 3) // 4  # cdiv(A + min(A, E) * (block - 1), block)
    flat = ids.reshape(-1)
    seen = []
    for block, expert in enumerate(block_experts.tolist()):
        rows = [i for i in sorted_ids[4 * block : 4 * block + 4].tolist() if i < flat.numel()]
        assert all(int(flat[i]) == expert for i in rows)
        assert expert < 6 or not rows
        seen += rows
    assert seen == torch.argsort(flat, stable=True).tolist()


def test_no_tokens_and_unknown_activation() -> None:
    h, weights, ids, w_gate_up, w_down = _inputs(0, torch.float32, "silu", 0)
    assert moe.routed_experts(h, weights, ids, w_gate_up, w_down).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="unknown expert activation"):
        moe.routed_experts(*_inputs(1, torch.float32, "silu", 0), "swish")
