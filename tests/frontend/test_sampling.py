"""Resolving a request's sampling options against a core's defaults and declared ranges (the
frontend's job); their types are the protocol decoder's (tests/protocols/test_sampling_types.py)."""

from __future__ import annotations

import pytest

from helios.core.sampling import Interval, SamplingDefaults, SamplingSpec
from helios.engine import SamplingParams
from helios.frontend import sampling
from helios.frontend.inference import RequestError, SamplingOptions
from helios.protocols.fields import sampling as decode_sampling

# The qwen38 recipe's shape: some parameters ranged, the rest fixed.
QWEN = SamplingSpec(
    defaults=SamplingDefaults(temperature=1.0, top_p=0.95, top_k=20, seed=11),
    ranges={
        "temperature": Interval(0.7, 1.0),
        "top_p": Interval(0.8, 0.95),
        "presence_penalty": Interval(0.0, 2.0),
    },
)


def _with_top_k_range(low: float, high: float, default: int = -1) -> SamplingSpec:
    return SamplingSpec(
        defaults=SamplingDefaults(temperature=1.0, top_p=1.0, top_k=default), ranges={"top_k": Interval(low, high)}
    )


def resolve_sampling(spec: SamplingSpec, body: dict, *, choice_index: int = 0, vocab_size: int | None = None):
    """The parameters a JSON body's sampling fields resolve to (decoded as every protocol does)."""
    options = decode_sampling(body)
    return sampling.resolve_sampling(spec, options, choice_index=choice_index, vocab_size=vocab_size)


def test_omitted_and_null_fields_take_defaults() -> None:
    expected = SamplingParams(1.0, 0.95, 20, 0.0, 1.0, 0.0, 0.0, seed=11)
    assert resolve_sampling(QWEN, {}) == expected
    assert resolve_sampling(QWEN, dict.fromkeys(["temperature", "top_p", "top_k", "seed"])) == expected


def test_values_clamp_into_declared_ranges() -> None:
    params = resolve_sampling(QWEN, {"temperature": 0, "top_p": 1.0, "presence_penalty": 1.5})
    assert params.temperature == 0.7  # temperature 0 becomes the declared minimum
    assert params.top_p == 0.95
    assert params.presence_penalty == 1.5
    assert resolve_sampling(QWEN, {"temperature": 3, "presence_penalty": -1.0}).presence_penalty == 0.0
    assert resolve_sampling(QWEN, {"temperature": 3}).temperature == 1.0


def test_parameters_without_range_are_fixed_at_default() -> None:
    params = resolve_sampling(QWEN, {"top_k": 5, "min_p": 0.5, "repetition_penalty": 1.3, "frequency_penalty": 1.0})
    assert (params.top_k, params.min_p, params.repetition_penalty, params.frequency_penalty) == (20, 0.0, 1.0, 0.0)
    fixed = resolve_sampling(QWEN.fixed(), {"temperature": 0, "top_p": 0.5, "presence_penalty": 2.0})
    assert (fixed.temperature, fixed.top_p, fixed.presence_penalty) == (1.0, 0.95, 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", -2), ("logit_bias", {"-1": 1}), ("logit_bias", {"1000000": 1}), ("logit_bias", {"3": 100.5})],
)
def test_out_of_domain_values_name_their_field(field: str, value: object) -> None:
    """Refused even where the core fixes the parameter, so a request fails the same way everywhere."""
    for spec in (QWEN, QWEN.fixed()):
        with pytest.raises(RequestError) as caught:
            resolve_sampling(spec, {field: value}, vocab_size=1000)
        assert caught.value.param == field
        assert field in str(caught.value)


def test_logit_bias_is_sorted_and_bounded() -> None:
    params = resolve_sampling(QWEN, {"logit_bias": {"7": -100, "3": 2.5}}, vocab_size=10)
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    with pytest.raises(RequestError, match=r"within \[-100, 100\], got 101$"):
        resolve_sampling(QWEN, {"logit_bias": {"3": 101}})  # the value as the client sent it
    with pytest.raises(RequestError, match="1025 entries; at most 1024"):
        resolve_sampling(QWEN, {"logit_bias": {str(i): 1 for i in range(1025)}})


def test_options_resolve_without_a_decoder() -> None:
    assert sampling.resolve_sampling(QWEN, SamplingOptions(temperature=0.0, top_k=0)).temperature == 0.7


def test_top_k_zero_means_disabled_and_disabled_clamps_as_infinity() -> None:
    allows_disabled = _with_top_k_range(-1, 200)
    assert resolve_sampling(allows_disabled, {"top_k": 0}).top_k == -1
    assert resolve_sampling(allows_disabled, {"top_k": -1}).top_k == -1
    assert resolve_sampling(allows_disabled, {"top_k": 500}).top_k == 200
    assert resolve_sampling(allows_disabled, {"top_k": 7}).top_k == 7
    bounded = _with_top_k_range(1, 50, default=20)
    assert resolve_sampling(bounded, {"top_k": 0}).top_k == 50
    assert resolve_sampling(bounded, {"top_k": -1}).top_k == 50
    assert resolve_sampling(bounded, {"top_k": 1}).top_k == 1
    assert isinstance(resolve_sampling(bounded, {"top_k": 3}).top_k, int)


def test_seed_advances_by_choice_index() -> None:
    assert [resolve_sampling(QWEN, {"seed": 7}, choice_index=i).seed for i in range(3)] == [7, 8, 9]
    assert resolve_sampling(QWEN, {}, choice_index=2).seed == 13  # prepared default 11
    assert resolve_sampling(QWEN, {"seed": 2**63 - 1}, choice_index=1).seed == 0
    assert resolve_sampling(QWEN, {"seed": -1}).seed == 2**63 - 1


def test_fresh_seed_when_neither_request_nor_core_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    unseeded = SamplingSpec(defaults=SamplingDefaults(temperature=1.0, top_p=1.0, top_k=-1))
    monkeypatch.setattr(sampling.secrets, "randbits", lambda bits: 41 if bits == 63 else -1)
    assert resolve_sampling(unseeded, {}, choice_index=1).seed == 42
    assert resolve_sampling(unseeded, {"seed": 5}).seed == 5


def test_fresh_seeds_differ_between_requests() -> None:
    unseeded = SamplingSpec(defaults=SamplingDefaults(temperature=1.0, top_p=1.0, top_k=-1))
    seeds = {resolve_sampling(unseeded, {}).seed for _ in range(8)}
    assert len(seeds) == 8
    assert all(0 <= seed < 2**63 for seed in seeds)
