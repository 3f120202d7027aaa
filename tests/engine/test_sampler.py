"""Each sampler stage with fixed seeds: every test fails if its stage is skipped."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from helios.engine.sampler import (
    MaskError,
    Sampler,
    apply_mask,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    argmax,
    draw,
    make_generator,
    position_generator,
)
from helios.engine.sampling_params import SamplingParams

NEUTRAL = SamplingParams(
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seed=0,
)
NUM_DRAWS = 200


def _params(**changes: object) -> SamplingParams:
    return dataclasses.replace(NEUTRAL, **changes)


def _no_ids(batch: int) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=torch.int64)] * batch


def _counts(
    row: list[float], params: SamplingParams, num: int = NUM_DRAWS, allowed: list[bool] | None = None
) -> Counter:
    """Token counts over `num` rows of the same logits, each with its own fixed seed."""
    logits = torch.tensor([row]).expand(num, -1)
    mask = None if allowed is None else torch.tensor([allowed]).expand(num, -1)
    tokens = Sampler().sample(
        logits, [params] * num, [make_generator(seed) for seed in range(num)], _no_ids(num), _no_ids(num), mask
    )
    return Counter(tokens.tolist())


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_top_k_never_yields_tokens_below_the_kth() -> None:
    row = [3.0, 2.9, 2.8, 2.7]
    assert _counts(row, NEUTRAL)[2] > 20  # without top-k the third token is common
    counts = _counts(row, _params(top_k=2))
    assert set(counts) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    row = _log([0.5, 0.3, 0.2])
    assert _counts(row, NEUTRAL)[2] > 20
    assert set(_counts(row, _params(top_p=0.7))) == {0, 1}
    assert set(_counts(row, _params(top_p=0.01))) == {0}  # the top token always survives


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    row = _log([0.5, 0.3, 0.2])
    assert set(_counts(row, _params(min_p=0.5))) == {0, 1}  # threshold 0.25
    assert set(_counts(row, _params(min_p=1.0))) == {0}


def test_temperature_sharpens_and_flattens() -> None:
    row = [2.0, 0.0]  # p(1) = 0.12 at temperature 1
    assert 5 < _counts(row, NEUTRAL)[1] < 45
    assert _counts(row, _params(temperature=0.05))[1] == 0
    assert _counts(row, _params(temperature=10.0))[1] > 70  # p(1) = 0.45


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.5]])
    prompt, output = [torch.tensor([2])], [torch.tensor([0, 0])]
    got = apply_penalties(logits, prompt, output, [_params(repetition_penalty=2.0)])
    assert got.tolist() == [[1.0, 1.5, -2.0, -1.5]]  # prompt and output tokens alike, once each


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0]])
    prompt, output = [torch.tensor([1])], [torch.tensor([0, 0, 0, 2])]
    got = apply_penalties(logits, prompt, output, [_params(presence_penalty=0.5, frequency_penalty=0.25)])
    assert got.tolist() == [[0.75, 1.5, 0.25]]


@pytest.mark.parametrize(
    "changes", [{"repetition_penalty": 2.0}, {"presence_penalty": 1.0}, {"frequency_penalty": 0.2}]
)
def test_penalties_change_the_greedy_token(changes: dict[str, float]) -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    output = [torch.tensor([0, 0, 0])]
    sample = Sampler().sample
    args = ([make_generator(0)], _no_ids(1), output)
    assert sample(logits, [_params(top_k=1)], *args).tolist() == [0]
    assert sample(logits, [_params(top_k=1, **changes)], *args).tolist() == [1]


def test_neutral_stages_return_their_input_untouched() -> None:
    logits = torch.randn(3, 8)
    params = [NEUTRAL] * 3
    ids = [torch.tensor([1, 2])] * 3
    assert apply_penalties(logits, ids, ids, params) is logits
    for stage in (apply_temperature, apply_top_k, apply_top_p, apply_min_p):
        assert stage(logits, params) is logits
    assert apply_mask(logits, None) is logits


def test_stages_apply_per_row_parameters() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(2, -1)
    kept = apply_top_k(logits, [_params(top_k=1), _params(top_k=3)]).isfinite()
    assert kept.tolist() == [[True, False, False, False], [True, True, True, False]]


def test_mask_restricts_draws_and_rejects_empty_rows() -> None:
    row = [5.0, 4.0, 0.0, 1.0]
    assert set(_counts(row, NEUTRAL, allowed=[False, False, True, True])) == {2, 3}
    assert set(_counts(row, _params(top_k=1), allowed=[False, False, True, False])) == {2}
    allowed = torch.tensor([[True, False], [False, False], [False, False]])
    with pytest.raises(MaskError, match=r"no token in batch rows \[1, 2\]") as caught:
        apply_mask(torch.zeros(3, 2), allowed)
    assert caught.value.rows == [1, 2]


def test_top_k_one_is_exact_greedy_with_lowest_id_on_ties() -> None:
    row = [1.0, 3.0, 3.0, 2.9]
    assert set(_counts(row, _params(top_k=1))) == {1}
    assert set(_counts(row, _params(top_k=1, temperature=0.3, top_p=0.5))) == {1}
    assert set(_counts(row, _params(top_k=2))) == {1, 2}  # ties at the k-th are all kept


def test_draw_matches_the_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    num = 4000
    logits = torch.tensor([_log(probs)]).expand(num, -1)
    tokens = draw(logits, [make_generator(seed) for seed in range(num)])
    counts = Counter(tokens.tolist())
    for token, p in enumerate(probs):
        assert abs(counts[token] / num - p) < 0.03


def test_same_seed_and_logits_reproduce_the_tokens() -> None:
    logits = torch.randn(4, 50, generator=make_generator(123))
    params = [_params(temperature=0.8, top_p=0.9, top_k=30)] * 4

    def run(seeds: list[int]) -> list[int]:
        generators = [make_generator(seed) for seed in seeds]
        return Sampler().sample(logits, params, generators, _no_ids(4), _no_ids(4)).tolist()

    assert run([1, 2, 3, 4]) == run([1, 2, 3, 4])
    assert run([1, 2, 3, 4]) != run([5, 6, 7, 8])


def test_a_row_does_not_depend_on_its_batch_neighbours() -> None:
    logits = torch.randn(3, 50, generator=make_generator(7))
    alone = Sampler().sample(logits[1:2], [NEUTRAL], [make_generator(9)], _no_ids(1), _no_ids(1))
    generators = [make_generator(1), make_generator(9), make_generator(2)]
    batched = Sampler().sample(logits, [NEUTRAL] * 3, generators, _no_ids(3), _no_ids(3))
    assert batched[1] == alone[0]


def test_generator_advances_across_steps() -> None:
    logits = torch.zeros(1, 1000)  # uniform: repeated tokens would mean a repeated stream
    generator = make_generator(0)
    steps = [draw(logits, [generator]).item() for _ in range(5)]
    assert len(set(steps)) == 5
    replay = make_generator(0)
    assert [draw(logits, [replay]).item() for _ in range(5)] == steps


def test_zero_probability_tokens_are_never_drawn() -> None:
    """Inverse-CDF draws land only on tokens with mass, the first and last tokens included."""
    inf = float("-inf")
    row = [0.0, inf, inf, -1.0, inf, 2.0, inf, -0.5]
    num = 3000
    tokens = draw(torch.tensor([row]).expand(num, -1), [make_generator(seed) for seed in range(num)])
    counts = Counter(tokens.tolist())
    assert set(counts) == {0, 3, 5, 7}
    probs = torch.tensor(row).softmax(-1)
    for token in counts:
        assert abs(counts[token] / num - float(probs[token])) < 0.03


@pytest.mark.parametrize("vocab", [49152, 1000, 4096 + 64, 300])
def test_blocked_argmax_is_torch_argmax(vocab: int) -> None:
    """The first maximum of each row, ties, NaN (torch counts it as the maximum) and -inf rows included."""
    logits = torch.randn(7, vocab, generator=make_generator(5)).mul_(4).round_()  # many ties at the top
    logits[1, vocab // 3] = logits[1, vocab - 1] = 99.0  # tie across blocks: the first wins
    logits[2, 5:] = float("-inf")
    logits[3, vocab - 2] = logits[3, vocab // 2] = float("nan")
    logits[4] = float("-inf")
    logits[5, 0] = float("inf")
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax(logits[:, :-1]).tolist() == logits[:, :-1].argmax(dim=-1).tolist()  # rows with a stride


def test_reused_buffers_change_no_draw() -> None:
    """The sampler's reused full-vocabulary buffers (Scratch) give the draws of fresh tensors, across
    calls of different batch sizes, for nucleus, temperature-only and mixed greedy batches."""
    logits = torch.randn(9, 4096, generator=make_generator(11)) * 3
    kinds = [
        _params(temperature=0.2, top_p=0.9, seed=1),
        _params(temperature=0.7, seed=2),
        _params(top_k=1),
        _params(temperature=1.3, top_k=40, seed=3),
    ]
    sampler = Sampler()
    for rows in (9, 3, 9, 1, 5):
        params = [kinds[(row + rows) % len(kinds)] for row in range(rows)]
        for step in range(2):
            fresh = Sampler()
            fresh.scratch = None
            expected = fresh.sample(logits[:rows], params, _generators(params, step), _no_ids(rows), _no_ids(rows))
            reused = sampler.sample(logits[:rows], params, _generators(params, step), _no_ids(rows), _no_ids(rows))
            assert reused.tolist() == expected.tolist()


def _generators(params: list[SamplingParams], step: int) -> list[torch.Generator]:
    return [position_generator(p.seed, step) for p in params]
