"""flare::gated_delta_rule (helios.core.ops.gated_delta): the reference kernel and helios' CPU
kernel against transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule,
on mixed batches: fresh prompts longer than a chunk, chunks that start mid-sequence from a
non-zero state, decode rows from a state and fresh one-token prompts."""

from __future__ import annotations

import pytest
import torch

from helios.core.ops import gated_delta as ops_gated_delta
from helios.engine.kernels import gated_delta as kernels_gated_delta

HK, HV, DK, DV = 2, 4, 8, 6
SLOTS = 7

# (rows this step, first position): 0 = a fresh sequence, else it continues from its slot.
CASES = {
    "mixed": [(70, 0), (16, 37), (1, 12), (1, 0), (5, 3), (1, 90)],
    "decode only": [(1, 5), (1, 1), (1, 0), (1, 44)],
    "one long prompt": [(131, 0)],
    "continued chunks": [(16, 16), (16, 32), (3, 61)],
}


def _batch(seed: int, case: list[tuple[int, int]]):
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for n, _ in case)
    q = torch.randn(total, HK, DK, generator=gen)
    k = torch.randn(total, HK, DK, generator=gen)
    v = torch.randn(total, HV, DV, generator=gen)
    g = -torch.rand(total, HV, generator=gen) * 0.5  # log decays in (-0.5, 0]
    beta = torch.rand(total, HV, generator=gen)
    pool = torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.3
    slots = torch.randperm(SLOTS, generator=gen)[: len(case)]
    starts = torch.tensor([0, *torch.tensor([n for n, _ in case]).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(p, p + n) for n, p in case])
    return q, k, v, g, beta, pool, slots, starts, positions


def _transformers(q, k, v, g, beta, pool, slots, starts, positions, recurrent: bool):
    """Each sequence alone through transformers' torch gated delta rule: (out, final states by slot)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    outs, finals = [], {}
    for b, slot in enumerate(slots.tolist()):
        start, end = int(starts[b]), int(starts[b + 1])
        initial = None if int(positions[start]) == 0 else pool[slot][None].clone()
        args = (q[None, start:end], k[None, start:end], v[None, start:end], g[None, start:end], beta[None, start:end])
        kwargs = {"initial_state": initial, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        if recurrent:
            out, final = torch_recurrent_gated_delta_rule(*args, **kwargs)
        else:
            out, final = torch_chunk_gated_delta_rule(*args, chunk_size=64, **kwargs)
        outs.append(out[0])
        finals[slot] = final[0]
    return torch.cat(outs), finals


@pytest.mark.parametrize("kernel", ["reference", "cpu", "cpu in place"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_transformers(kernel: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "cpu in place": decode rows update their slots in place, as for real models' large states."""
    if kernel == "cpu in place":
        monkeypatch.setattr(kernels_gated_delta, "_IN_PLACE_BYTES", 0)
    q, k, v, g, beta, pool, slots, starts, positions = _batch(sorted(CASES).index(name), CASES[name])
    run = ops_gated_delta.gated_delta_rule if kernel == "reference" else kernels_gated_delta.gated_delta_rule_cpu
    state = pool.clone()
    out = run(q, k, v, g, beta, state, slots, starts, positions, DK**-0.5, True)
    for recurrent in (False, True):
        expected, finals = _transformers(q, k, v, g, beta, pool, slots, starts, positions, recurrent)
        assert float((out - expected).abs().max()) <= 1e-5, recurrent
        for slot, final in finals.items():
            assert float((state[slot] - final).abs().max()) <= 1e-5, (recurrent, slot)
    untouched = sorted(set(range(SLOTS)) - set(slots.tolist()))
    assert torch.equal(state[untouched], pool[untouched])


def test_chunks_carry_the_state_of_one_long_prompt() -> None:
    """A 150-token prompt prefilled in chunks of 16 then decoded one token at a time through the
    slot equals the same tokens in one call (the state is all that crosses a step)."""
    n = 150
    q, k, v, g, beta, pool, _, _, _ = _batch(11, [(n, 0)])

    def rows(start: int, end: int, state: torch.Tensor) -> torch.Tensor:
        """Rows [start, end) of the prompt as one step of the sequence in slot 3."""
        inputs = (t[start:end] for t in (q, k, v, g, beta))
        starts = torch.tensor([0, end - start], dtype=torch.int32)
        run = kernels_gated_delta.gated_delta_rule_cpu
        return run(*inputs, state, torch.tensor([3]), starts, torch.arange(start, end), DK**-0.5, True)

    whole = rows(0, n, pool.clone())
    state = torch.full_like(pool, float("nan"))  # a fresh sequence never reads its slot
    bounds = list(range(0, 128, 16)) + list(range(128, n + 1))
    parts = [rows(start, end, state) for start, end in zip(bounds, bounds[1:])]
    assert float((torch.cat(parts) - whole).abs().max()) <= 1e-5
