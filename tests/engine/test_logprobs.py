"""Logprob shaping: alternative order and ties, explicit ids, prompt entries."""

from __future__ import annotations

import math

import pytest
import torch

from helios.engine.logprobs import (
    RankedLogprob,
    dedupe_token_ids,
    explicit_alternatives,
    natural_alternatives,
    prompt_entry,
)


def _program_outputs(logits: torch.Tensor, num_top: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """What a program returns for one row: logsumexp and torch.topk over the logprobs."""
    lse = torch.logsumexp(logits, dim=-1)
    top = torch.topk(logits - lse, num_top)
    return float(lse), top.values, top.indices


def _reference(logits: torch.Tensor, lse: float, num: int) -> list[tuple[int, float]]:
    """The spec's order by brute force: decreasing logprob, then increasing id."""
    logprobs = (logits - lse).tolist()
    order = sorted(range(len(logprobs)), key=lambda i: (-logprobs[i], i))
    return [(i, logprobs[i]) for i in order[:num]]


def test_alternatives_without_ties_follow_topk() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    lse, values, ids = _program_outputs(logits, 5)
    got = natural_alternatives(logits, lse, values, ids, 3)
    assert got == tuple(_reference(logits, lse, 3))
    assert natural_alternatives(logits, lse, values, ids, 0) == ()


def test_tie_inside_the_list_prefers_the_lower_id() -> None:
    logits = torch.tensor([0.0, -5.0, 1.0, -5.0, 1.0, 2.0])
    lse = float(torch.logsumexp(logits, 0))
    values = logits[[5, 4, 2]] - lse  # topk may put id 4 before id 2
    got = natural_alternatives(logits, lse, values, torch.tensor([5, 4, 2]), 2)
    assert [token for token, _ in got] == [5, 2]


def test_tie_beyond_the_list_prefers_the_lower_id() -> None:
    # N == num: the tied id 1 is not in the list at all, only a scan of the row finds it.
    logits = torch.tensor([0.0, 1.0, -3.0, 1.0, 2.0])
    lse = float(torch.logsumexp(logits, 0))
    values = logits[[4, 3]] - lse
    got = natural_alternatives(logits, lse, values, torch.tensor([4, 3]), 2)
    assert [token for token, _ in got] == [4, 1]
    assert got[1][1] == pytest.approx(1.0 - lse)


@pytest.mark.parametrize("seed", range(20))
def test_alternatives_match_brute_force_on_tie_heavy_rows(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (40,), generator=generator).float()  # many ties
    lse, values, ids = _program_outputs(logits, 8)
    # Shuffle the order of equal values, as a topk kernel is free to.
    shuffled = torch.argsort(values + torch.rand(8, generator=generator) * 1e-3, descending=True)
    shuffled_ids = ids[shuffled]
    for num in range(1, 9):
        assert natural_alternatives(logits, lse, values, shuffled_ids, num) == tuple(_reference(logits, lse, num))


def test_more_alternatives_than_the_core_returns_is_an_error() -> None:
    logits = torch.zeros(4)
    with pytest.raises(ValueError, match="at most 2"):
        natural_alternatives(logits, 0.0, torch.zeros(2), torch.tensor([0, 1]), 3)


def test_explicit_alternatives_keep_caller_order_and_append_the_chosen() -> None:
    got = explicit_alternatives([5, 3, 5, 7], [-1.0, -2.0, -1.0, -3.0], chosen=9, chosen_logprob=-0.5)
    assert got == ((5, -1.0), (3, -2.0), (7, -3.0), (9, -0.5))
    present = explicit_alternatives([5, 3], [-1.0, -2.0], chosen=3, chosen_logprob=-2.0)
    assert present == ((5, -1.0), (3, -2.0))


def test_explicit_alternatives_hold_at_most_129_entries() -> None:
    ids = list(range(128))
    got = explicit_alternatives(ids + ids, [-1.0] * 256, chosen=500, chosen_logprob=-9.0)
    assert len(got) == 129
    assert got[-1] == (500, -9.0)


def test_dedupe_keeps_first_occurrence_order() -> None:
    assert dedupe_token_ids([4, 1, 4, 2, 1]) == [4, 1, 2]


def test_prompt_entry_puts_the_actual_token_first_with_shared_ranks() -> None:
    alternatives = ((3, -0.5), (1, -1.0), (8, -1.0), (2, -2.0))
    entry = prompt_entry(8, -1.0, 2, alternatives)
    assert list(entry) == [8, 3, 1, 2]  # the actual token once, then alternatives in order
    assert entry[8] == RankedLogprob(-1.0, 2)
    assert entry[1] == RankedLogprob(-1.0, 2)  # equal values share a rank
    assert entry[2] == RankedLogprob(-2.0, 4)


def test_prompt_entry_includes_an_actual_token_outside_the_alternatives() -> None:
    entry = prompt_entry(42, -math.inf, 1000, ((7, -0.1),))
    assert list(entry) == [42, 7]
    assert entry[42] == RankedLogprob(-9999.0, 1000)
    assert prompt_entry(42, -3.0, 5, ()) == {42: RankedLogprob(-3.0, 5)}
    assert prompt_entry(0, -1.0, 1, ((0, -1.0), (5, -math.inf)))[5] == RankedLogprob(-9999.0, 2)


def test_prompt_alternatives_tied_at_the_cut_off_keep_increasing_ids() -> None:
    """The scored program's top list may hold any member of a tie at the cut-off (torch.topk's
    order among ties is unspecified): prompt entries, like generation's, report the lowest ids."""
    from types import SimpleNamespace

    from helios.engine.engine import LLMEngine

    request = SimpleNamespace(prompt_logprobs=2, images=())
    seq = SimpleNamespace(request=request, token_ids=[1, 4, 4], num_prompt=3)
    chunk = SimpleNamespace(seq=seq, start=0, num_tokens=2)
    ids = torch.tensor([[5, 9, 3, 7], [5, 9, 3, 7]])
    values = torch.tensor([[-1.0, -2.0, -2.0, -3.0], [-1.0, -2.0, -2.0, -3.0]])
    scores = {
        "prompt_logprobs": torch.tensor([-2.5, -2.5]),
        "prompt_ranks": torch.tensor([4, 4]),
        "prompt_top_ids": ids,
        "prompt_top_logprobs": values,
    }
    entries = LLMEngine._prompt_entries(chunk, scores)
    assert entries[0] is None and list(entries[1]) == [4, 5, 3]  # the actual token, then 5 and the lower tied id
