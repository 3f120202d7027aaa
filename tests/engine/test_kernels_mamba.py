"""flare::mamba2_scan (helios.core.ops.mamba): the reference kernel against transformers' own
Mamba-2 torch pieces (Nemotron-H's chunked scan with initial and final states, and its
single-token state update), and helios' CPU kernel against the reference on mixed batches:
decode rows, chunks that start mid-sequence from non-zero state, fresh prompts, spans longer
than one SSD chunk, state slots scattered over the pool."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops import mamba as ops_mamba
from helios.engine.kernels import mamba as kernels_mamba

HEADS, DIM, GROUPS, STATE = 6, 4, 2, 5  # heads of DIM channels, GROUPS groups of B/C of size STATE
DT_MIN = 1e-3


def _params(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(A [H] negative, D [H], dt_bias [H]) as a trained layer might have them."""
    a = -torch.exp(torch.rand(HEADS, generator=gen) * 2.0)
    d = 1.0 + 0.1 * torch.randn(HEADS, generator=gen)
    dt = torch.exp(
        torch.rand(HEADS, generator=gen) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3))) - 6.9
    )
    return a, d, dt + torch.log(-torch.expm1(-dt))  # dt_bias: softplus^-1 of dt in [1e-3, 0.1]


def _rows(gen: torch.Generator, total: int) -> tuple[torch.Tensor, ...]:
    """(x [T, H, P], dt [T, H], B [T, G, N], C [T, G, N])."""
    return (
        torch.randn(total, HEADS, DIM, generator=gen),
        torch.randn(total, HEADS, generator=gen),
        torch.randn(total, GROUPS, STATE, generator=gen),
        torch.randn(total, GROUPS, STATE, generator=gen),
    )


def _one(rows: int, slot: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(state_slots, query_start_loc) of a step that is one sequence of `rows` rows in `slot`."""
    return torch.tensor([slot]), torch.tensor([0, rows], dtype=torch.int32)


def _hf():
    from transformers.models.nemotron_h import modeling_nemotron_h

    return modeling_nemotron_h


def test_reference_matches_transformers_chunked_scan() -> None:
    """A chunk that starts mid-sequence from a non-zero state: outputs and final state equal
    transformers' chunked torch scan (its chunks of 8 over 21 rows, padded), and a fresh one too."""
    gen = torch.Generator().manual_seed(0)
    a, d, dt_bias = _params(gen)
    x, dt, b, c = _rows(gen, 21)
    for fresh in (False, True):
        initial = torch.zeros(HEADS, DIM, STATE) if fresh else torch.randn(HEADS, DIM, STATE, generator=gen)
        pool = torch.randn(3, HEADS, DIM, STATE, generator=gen)
        pool[1] = initial
        positions = torch.arange(21) + (0 if fresh else 40)
        y = ops_mamba.mamba2_scan(x, dt, a, b, c, d, dt_bias, pool, *_one(21), positions, DT_MIN, 0.0)
        expected, final = _hf().mamba2_chunk_scan(
            x[None],
            dt[None],
            a,
            b[None],
            c[None],
            chunk_size=8,
            D=d,
            dt_bias=dt_bias,
            initial_states=None if fresh else initial[None],
            dt_softplus=True,
            dt_limit=(DT_MIN, float("inf")),
            return_final_states=True,
        )
        assert float((y - expected[0]).abs().max()) <= 1e-5
        assert float((pool[1] - final[0]).abs().max()) <= 1e-5


def test_reference_matches_transformers_state_update() -> None:
    """Decode steps of two sequences at once equal transformers' selective_state_update. That one
    does not clamp the time steps (its chunked scan clamps them at time_step_min), so neither
    does the op here (dt_min 0)."""
    gen = torch.Generator().manual_seed(1)
    a, d, dt_bias = _params(gen)
    pool = torch.randn(4, HEADS, DIM, STATE, generator=gen)
    theirs = pool[[3, 0]].clone()
    slots, starts = torch.tensor([3, 0]), torch.tensor([0, 1, 2], dtype=torch.int32)
    for step in range(3):
        x, dt, b, c = _rows(gen, 2)
        positions = torch.tensor([7 + step, 30 + step])
        y = ops_mamba.mamba2_scan(x, dt, a, b, c, d, dt_bias, pool, slots, starts, positions, 0.0, 0.0)
        expected = _hf().mamba2_selective_state_update(
            theirs,
            x,
            dt[:, :, None].expand(-1, -1, DIM),
            a[:, None, None].expand(-1, DIM, STATE),
            b,
            c,
            d[:, None].expand(-1, DIM),
            dt_bias=dt_bias[:, None].expand(-1, DIM),
            dt_softplus=True,
        )
        assert float((y - expected).abs().max()) <= 1e-5
        assert float((pool[slots] - theirs).abs().max()) <= 1e-5


# Per sequence: (rows this step, first position); position 0 = fresh, the others continue their slot.
CASES = {
    "decode only": [(1, 5), (1, 17), (1, 1), (1, 32)],
    "mixed": [(1, 9), (3, 4), (1, 20), (16, 0), (7, 16), (1, 0)],
    "long chunks": [(150, 0), (70, 33), (1, 12)],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_matches_the_reference(name: str) -> None:
    spans = CASES[name]
    gen = torch.Generator().manual_seed(2)
    a, d, dt_bias = _params(gen)
    total = sum(n for n, _ in spans)
    x, dt, b, c = _rows(gen, total)
    pool = torch.randn(len(spans) + 3, HEADS, DIM, STATE, generator=gen)
    slots = torch.randperm(len(spans) + 3, generator=gen)[: len(spans)]
    starts = torch.tensor([0, *torch.tensor([n for n, _ in spans]).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(first, first + n) for n, first in spans])
    args = (x, dt, a, b, c, d, dt_bias)
    ours, theirs = pool.clone(), pool.clone()
    y = kernels_mamba.mamba2_scan_cpu(*args, ours, slots, starts, positions, DT_MIN, 0.0)
    expected = ops_mamba.mamba2_scan(*args, theirs, slots, starts, positions, DT_MIN, 0.0)
    assert float((y - expected).abs().max()) <= 1e-4
    assert float((ours - theirs).abs().max()) <= 1e-4
    untouched = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(ours[untouched], pool[untouched])


def test_chunks_carry_the_state() -> None:
    """One prompt scanned whole == scanned in pieces of 16, 5 and 1 rows (the state through its slot)."""
    gen = torch.Generator().manual_seed(3)
    a, d, dt_bias = _params(gen)
    x, dt, b, c = _rows(gen, 90)
    pool = torch.zeros(2, HEADS, DIM, STATE)
    whole = kernels_mamba.mamba2_scan_cpu(x, dt, a, b, c, d, dt_bias, pool, *_one(90), torch.arange(90), DT_MIN, 0.0)
    final = pool[1].clone()
    for scan in (kernels_mamba.mamba2_scan_cpu, ops_mamba.mamba2_scan):
        pieces, start = [], 0
        pool = torch.randn(2, HEADS, DIM, STATE, generator=gen)  # slot contents ignored at position 0
        for size in [16, 5, 1, 1, 16, 51]:
            rows, positions = slice(start, start + size), torch.arange(start, start + size)
            piece = scan(x[rows], dt[rows], a, b[rows], c[rows], d, dt_bias, pool, *_one(size), positions, DT_MIN, 0.0)
            pieces.append(piece)
            start += size
        assert float((torch.cat(pieces) - whole).abs().max()) <= 1e-4
        assert float((pool[1] - final).abs().max()) <= 1e-4


def test_time_steps_are_clamped() -> None:
    """softplus(dt + bias) is clamped to [dt_min, dt_max] (dt_max 0: no upper bound)."""
    raw = torch.tensor([[-20.0, 0.0, 20.0]])
    bias = torch.zeros(3)
    assert torch.allclose(ops_mamba.time_steps(raw, bias, 1e-3, 0.0), torch.tensor([[1e-3, 0.6931472, 20.0]]))
    assert torch.allclose(ops_mamba.time_steps(raw, bias, 0.0, 1.0), torch.tensor([[2.0612e-09, 0.6931472, 1.0]]))
