"""Property-based fuzzing of every protocol decoder and of the body layer: whatever JSON
arrives, decoding either succeeds or raises the protocol's own request error (a 400/422),
never anything that would become a 500."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import slow_tests

from helios.frontend.inference import RequestError
from helios.protocols import anthropic_messages, decisions, ollama, openai_chat, openai_completions, systemone
from helios.protocols import openai_responses as responses
from helios.server.body import BodyError, decode
from helios.server.json_body import JsonBodyError, parse_json

# examples per decoder: all 300 with FLARE_SLOW_TESTS=1, a third in CI (each example is a fresh draw)
FUZZ = settings(max_examples=300 if slow_tests() else 100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25,
)

# Field names each protocol reads, so the fuzzer reaches past "unknown field" checks.
CHAT_KEYS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logit_bias",
    "reasoning_effort",
    "chat_template_kwargs",
    "parallel_tool_calls",
    "ignore_eos",
    "stop_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "return_token_ids",
]
MESSAGE_KEYS = [
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "type",
    "text",
    "image_url",
    "function",
    "arguments",
    "id",
    "input",
    "tool_use_id",
    "is_error",
    "source",
    "thinking",
    "signature",
]
COMPLETION_KEYS = [
    "model",
    "prompt",
    "max_tokens",
    "n",
    "echo",
    "logprobs",
    "stream",
    "stop",
    "suffix",
    "seed",
    "best_of",
    "stream_options",
    "prompt_logprobs",
]
RESPONSES_KEYS = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "stream",
    "store",
    "previous_response_id",
    "include",
    "top_logprobs",
    "parallel_tool_calls",
]
MESSAGES_KEYS = [
    "model",
    "messages",
    "system",
    "max_tokens",
    "stream",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "temperature",
    "top_k",
    "output_config",
    "stop_token_ids",
]


def objects(keys: list[str]) -> st.SearchStrategy[dict]:
    nested = st.dictionaries(st.sampled_from(MESSAGE_KEYS), json_values, max_size=5)
    value = json_values | st.lists(nested, max_size=3) | nested
    return st.dictionaries(st.sampled_from(keys), value, max_size=8)


def _decodes_or_refuses(fn, body) -> None:
    try:
        fn(body)
    except (RequestError, systemone.SchemaError, ollama.DiscoveryError):
        pass


@FUZZ
@given(objects(CHAT_KEYS))
def test_chat_decoder(body: dict) -> None:
    _decodes_or_refuses(openai_chat.decode, body)


@FUZZ
@given(objects(COMPLETION_KEYS))
def test_completions_decoder(body: dict) -> None:
    _decodes_or_refuses(openai_completions.decode, body)


@FUZZ
@given(objects(RESPONSES_KEYS))
def test_responses_decoder(body: dict) -> None:
    _decodes_or_refuses(responses.decode, body)


@FUZZ
@given(objects(MESSAGES_KEYS), st.sampled_from([None, "2023-06-01", "2026-10-21", "garbage"]))
def test_messages_decoder(body: dict, version) -> None:
    _decodes_or_refuses(lambda b: anthropic_messages.decode(b, headers_version=version), body)
    _decodes_or_refuses(lambda b: anthropic_messages.count_tokens_decode(b, version), body)


@FUZZ
@given(objects(["model", "messages", "questions", "labels", "input", "text"]))
def test_scoring_decoders(body: dict) -> None:
    _decodes_or_refuses(decisions.decode, body)
    _decodes_or_refuses(systemone.decode, body)


@FUZZ
@given(json_values)
def test_ollama_show_decoder(body) -> None:
    _decodes_or_refuses(ollama.decode_show, body)


@FUZZ
@given(st.binary(max_size=200))
def test_body_layer_never_fails_unexpectedly(raw: bytes) -> None:
    for coding in ("gzip", "deflate", "br", "zstd"):
        try:
            decode(raw, [coding], 1 << 16)
        except BodyError as exc:
            assert exc.status in (400, 413)
    try:
        parse_json(raw)
    except JsonBodyError:
        pass


@pytest.mark.parametrize("wrap", [gzip.compress, zlib.compress])
def test_compressed_deep_json_is_refused_after_decoding(wrap) -> None:
    with pytest.raises(JsonBodyError, match="levels deep"):
        parse_json(decode(wrap(b"[" * 50_000), ["gzip" if wrap is gzip.compress else "deflate"], 1 << 20))
