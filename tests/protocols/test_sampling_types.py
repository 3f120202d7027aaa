"""Sampling field types are checked by every protocol decoder, before admission, with the same
message everywhere; ranges are the frontend's (tests/frontend/test_sampling.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from helios.frontend.inference import InferenceRequest, RequestError, SamplingOptions
from helios.protocols import anthropic_messages, openai_chat, openai_completions
from helios.protocols import openai_responses as responses

HI = [{"role": "user", "content": "hi"}]
DECODERS: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], tuple]]] = {
    "chat": ({"model": "x", "messages": HI}, openai_chat.decode),
    "completions": ({"model": "x", "prompt": "hi"}, openai_completions.decode),
    "messages": (
        {"model": "x", "messages": HI, "max_tokens": 8},
        lambda body: anthropic_messages.decode(body, headers_version="2023-06-01"),
    ),
    "responses": ({"model": "x", "input": "hi"}, responses.decode),
}


def _decode(protocol: str, **fields: Any) -> InferenceRequest:
    base, decode = DECODERS[protocol]
    return decode({**base, **fields})[0]


@pytest.mark.parametrize("protocol", DECODERS)
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "hot", "temperature must be a number, got str"),
        ("temperature", True, "temperature must be a number, got bool"),
        ("top_p", [0.5], "top_p must be a number, got list"),
        ("min_p", 10**400, "min_p must be finite, got 1" + "0" * 400),  # too large for a float
        ("top_k", 5.0, "top_k must be an integer, got float"),  # not truncated: top_k is an integer
        ("top_k", "5", "top_k must be an integer, got str"),
        ("seed", 1.5, "seed must be an integer, got float"),
        ("seed", False, "seed must be an integer, got bool"),
        ("logit_bias", [1, 2], "logit_bias must be an object of token id -> bias, got list"),
        ("logit_bias", {"x": 1}, "logit_bias keys must be token ids, got 'x'"),
        ("logit_bias", {"3": "1"}, "logit_bias must be a number, got str"),
    ],
)
def test_malformed_sampling_types_are_refused_by_the_decoder(
    protocol: str, field: str, value: Any, message: str
) -> None:
    with pytest.raises(RequestError) as caught:
        _decode(protocol, **{field: value})
    assert caught.value.param == field and caught.value.message == message


@pytest.mark.parametrize("protocol", DECODERS)
def test_well_typed_values_reach_the_neutral_request_unclamped(protocol: str) -> None:
    request = _decode(protocol, temperature=0, top_k=-7, seed=-1, logit_bias={"5": 200})
    assert request.sampling == SamplingOptions(temperature=0.0, top_k=-7, seed=-1, logit_bias=((5, 200),))
    assert _decode(protocol).sampling == SamplingOptions()  # omitted: the core's defaults, resolved later
