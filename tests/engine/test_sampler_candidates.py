"""The candidate fast path draws from exactly the distribution the full-vocabulary path does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helios.engine import sampler as s
from helios.engine.sampling_params import SamplingParams
from tests.engine.test_sampler import NEUTRAL


def _params(**kw) -> SamplingParams:
    return replace(NEUTRAL, **{"temperature": 0.7, **kw})


def _full_path_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = s.apply_temperature(logits[None], [params])
    row = s.apply_min_p(s.apply_top_p(s.apply_top_k(row, [params]), [params]), [params])
    return row.softmax(dim=-1)[0]


def test_candidate_draws_match_the_full_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5000) * 3
    for params in (_params(top_p=0.9), _params(top_k=40), _params(top_k=200, top_p=0.8, min_p=0.05)):
        expected = _full_path_probs(logits, params)
        rows = logits[None].repeat(4000, 1)
        generators = [torch.Generator().manual_seed(i) for i in range(4000)]
        drawn, _ = s._draw_among_candidates(
            s.apply_temperature(rows, [params] * 4000), [params] * 4000, generators, s.TOP_P_CANDIDATES, None
        )
        assert drawn is not None
        observed = torch.bincount(drawn, minlength=5000).float() / 4000
        assert set(observed.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
        assert float((observed - expected).abs().sum()) < 0.12  # total variation of 4000 samples


def test_rows_sampling_the_whole_vocabulary_use_the_full_path() -> None:
    logits = torch.randn(2, 5000)
    both = [_params(), _params(top_p=0.5)]
    assert s._draw_among_candidates(logits, both, [torch.Generator()] * 2, s.TOP_P_CANDIDATES, None)[0] is None
    flat = torch.zeros(1, 5000)  # a top-p nucleus wider than the candidates
    assert (
        s._draw_among_candidates(flat, [_params(top_p=0.9)], [torch.Generator()], s.TOP_P_CANDIDATES, None)[0] is None
    )


def test_small_candidate_sets_fall_back_to_larger_ones() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 5000) * 0.5  # a flat-ish distribution: 128 tokens hold too little mass
    params = [_params(top_p=0.9)]
    drawn, lse = s._draw_among_candidates(logits, params, [torch.Generator()], 128, None)
    assert drawn is None and torch.allclose(lse, torch.logsumexp(logits, dim=-1))
    assert s.Sampler().sample(logits, params, [torch.Generator()], [torch.empty(0)], [torch.empty(0)]).shape == (1,)


def test_logsumexp_matches_torch_with_underflowing_terms() -> None:
    x = torch.randn(4, 5000) * 40
    x[0, :10] = float("-inf")
    assert torch.allclose(s.logsumexp(x), torch.logsumexp(x, dim=-1), rtol=0, atol=1e-5)


def test_a_row_draws_the_same_whatever_shares_its_batch() -> None:
    """Each row takes its own candidate set: a sharp row keeps its 128-candidate draw even when a
    flat row in the same batch needs the full vocabulary (speculative verification rows and
    other requests join batches freely)."""
    torch.manual_seed(1)
    sharp = torch.randn(1, 5000) * 4
    flat = torch.randn(1, 5000) * 0.01  # a top-p 0.9 nucleus far wider than 1024 tokens
    params = [_params(top_p=0.9, seed=3), _params(top_p=0.9, seed=4)]
    for seed in range(20):
        alone = s.Sampler._draw(sharp.clone(), params[:1], [s.position_generator(seed, 0)])
        mixed = s.Sampler._draw(
            torch.cat([sharp, flat]), params, [s.position_generator(seed, 0), s.position_generator(9, 0)]
        )
        assert int(alone[0]) == int(mixed[0])


def _native() -> bool:
    from helios.engine import native

    return native.load()


def test_native_draws_are_the_torch_paths_draws_from_the_same_uniform() -> None:
    """native/sampling.cpp's nucleus_draw against the torch path (temperature, top-p, min-p over the
    candidates, then the inverse-CDF draw) on the same uniforms: the same token, row by row, for
    sharp and broad rows, ties at the top, masked tokens and an odd vocabulary; a flat row (more
    candidates than the cap), a NaN row and a nucleus wider than the candidates say -1."""
    if not _native():
        pytest.skip("no native kernels here")
    torch.manual_seed(2)
    logits = torch.randn(7, 5003) * 4  # an odd vocabulary: the 8-lane pass has a tail
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top
    logits[2] = torch.randn(5003) * 0.01  # flat: far more than `cap` tokens qualify
    logits[3, 100] = float("nan")
    logits[4, :2000] = float("-inf")  # masked tokens
    logits[6] = -5.0  # 100 candidates (within log(1/128) of the top) holding 0.75 of the mass: not 0.95
    logits[6, :100] = 0.0
    settings = [(0.2, 0.9, 0.0), (0.7, 0.8, 0.0), (1.0, 0.9, 0.0), (1.0, 0.9, 0.0), (0.5, 0.95, 0.05), (1.3, 0.7, 0.1)]
    settings.append((1.0, 0.95, 0.0))
    params = [_params(temperature=t, top_p=p, min_p=m) for t, p, m in settings]
    for seed in range(200):
        uniforms = [torch.Generator().manual_seed(seed * 7 + r) for r in range(7)]
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in uniforms])
        drawn = torch.ops.flare_native.nucleus_draw(logits, torch.tensor(settings), u, 128).tolist()
        assert drawn[2] == drawn[3] == drawn[6] == -1
        for r in (0, 1, 4, 5):
            again = [torch.Generator().manual_seed(seed * 7 + r)]
            expected = s.Sampler._torch_draw(logits[r : r + 1].clone(), [params[r]], again)
            assert drawn[r] == int(expected[0]), (seed, r)
    with pytest.raises(RuntimeError, match="settings must be"):
        torch.ops.flare_native.nucleus_draw(logits, torch.zeros(7, 2), u, 128)


def test_native_draws_match_the_full_distribution_and_ignore_the_batch() -> None:
    if not _native():
        pytest.skip("no native kernels here")
    torch.manual_seed(0)
    logits = torch.randn(5000) * 3
    for params in (_params(top_p=0.9), _params(top_p=0.8, min_p=0.05, temperature=0.3)):
        expected = _full_path_probs(logits, params)
        rows = logits[None].repeat(4000, 1)
        out = torch.empty(4000, dtype=torch.int64)
        generators = [torch.Generator().manual_seed(i) for i in range(4000)]
        assert s._native_nucleus(rows, [params] * 4000, generators, out) == list(range(4000))
        observed = torch.bincount(out, minlength=5000).float() / 4000
        assert set(observed.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
        assert float((observed - expected).abs().sum()) < 0.12
    # A row draws the same alone, beside a flat row (torch path) and beside a top-k row.
    sharp, flat = torch.randn(1, 5000) * 4, torch.randn(1, 5000) * 0.01
    params = [_params(top_p=0.9), _params(top_p=0.9), _params(top_k=5)]
    for seed in range(20):
        alone = s.Sampler._draw(sharp.clone(), params[:1], [s.position_generator(seed, 0)])
        mixed = s.Sampler._draw(
            torch.cat([flat, sharp, sharp]),
            [params[1], params[0], params[2]],
            [s.position_generator(9, 0), s.position_generator(seed, 0), s.position_generator(4, 0)],
        )
        assert int(alone[0]) == int(mixed[1])
