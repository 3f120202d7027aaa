"""Output limits over HTTP as real clients meet them: the advertised default applies on every
generation route, an over-long limit is bounded by the remaining context (reporting the limit
cause), only a prompt that leaves no room is refused, and the anthropic SDK's own version works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from serving import API_KEY, Server, running_server

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend.inference import Conversation, Message, TextPart
from helios.frontend.request import Frontend

DEFAULT = 5


@pytest.fixture(scope="module")
def limited(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tiny_core, tmp_path_factory.mktemp("limited"), default_max_tokens=DEFAULT) as instance:
        yield instance


@pytest.fixture(scope="module")
def near_full(tiny_core: Path) -> tuple[str, int]:
    """A user message whose chat prompt leaves a few (1..8) tokens of context, and the context."""
    frontend = Frontend(Core.open(tiny_core, verify_checksums=False), ServerConfig())

    def prompt_len(words: int) -> int:
        return len(frontend.prompt(Conversation((Message("user", (TextPart("hello " * words),)),))).token_ids)

    low, high = 1, frontend.max_model_len  # the most words whose prompt leaves at least one token
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if prompt_len(middle) < frontend.max_model_len else (low, middle - 1)
    assert 1 <= frontend.max_model_len - prompt_len(low) <= 8
    return "hello " * low, frontend.max_model_len


def test_models_advertise_the_effective_integer_default(server: Server, limited: Server) -> None:
    card = server.get("/v1/models").json()["data"][0]
    assert card["flare"]["default_max_tokens"] == card["max_model_len"]
    assert limited.get("/v1/models").json()["data"][0]["flare"]["default_max_tokens"] == DEFAULT
    # docs/serving.md: the device ("auto" is CPU on a host without CUDA) and whether CUDA graphs are on
    assert (card["flare"]["device"], card["flare"]["cuda_graphs"]) == ("cpu", False) or card["flare"]["device"] != "cpu"
    assert set(server.metrics()["graph_launches"]) == {"graph", "eager"}


def test_every_route_applies_the_configured_default(limited: Server) -> None:
    chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    completion = limited.post("/v1/completions", {"model": "x", "prompt": "Hello", "ignore_eos": True}).json()
    assert completion["usage"]["completion_tokens"] == DEFAULT and completion["choices"][0]["finish_reason"] == "length"
    answer = limited.post("/v1/chat/completions", chat).json()
    assert answer["usage"]["completion_tokens"] == DEFAULT and answer["choices"][0]["finish_reason"] == "length"
    response = limited.post("/v1/responses", {"model": "x", "input": "Hi", "ignore_eos": True}).json()
    assert response["usage"]["output_tokens"] == DEFAULT and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_over_long_limit_is_bounded_by_the_remaining_context(server: Server, near_full: tuple[str, int]) -> None:
    # Claude Code and OpenCode send max_tokens 32000 whatever the model's context.
    text, context = near_full
    messages = [{"role": "user", "content": text}]
    chat = server.post(
        "/v1/chat/completions", {"model": "x", "messages": messages, "max_tokens": 32000, "ignore_eos": True}
    )
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    room = context - usage["prompt_tokens"]
    assert usage["completion_tokens"] == room and chat.json()["choices"][0]["finish_reason"] == "length"
    responses = server.post(
        "/v1/responses", {"model": "x", "input": messages, "max_output_tokens": 32000, "ignore_eos": True}
    ).json()
    assert responses["usage"]["output_tokens"] == room and responses["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    completion = server.post(
        "/v1/completions", {"model": "x", "prompt": [5] * (context - 3), "max_tokens": 32000, "ignore_eos": True}
    ).json()
    assert completion["usage"]["completion_tokens"] == 3 and completion["choices"][0]["finish_reason"] == "length"
    headers = {"anthropic-version": "2023-06-01"}
    message = server.post(
        "/v1/messages", {"model": "x", "messages": messages, "max_tokens": 32000, "seed": 1}, headers=headers
    )
    assert message.status_code == 200, message.text
    body = message.json()
    usage = body["usage"]  # input_tokens counts only what the prefix cache did not supply
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == context
    assert body["stop_reason"] == "max_tokens"


def test_a_prompt_that_leaves_no_room_is_still_refused(server: Server, near_full: tuple[str, int]) -> None:
    text, context = near_full
    full = server.post("/v1/completions", {"model": "x", "prompt": [5] * context, "max_tokens": 1})
    assert (
        full.status_code == 400
        and full.json()["error"]["param"] is None
        and "prompt" in full.json()["error"]["message"]
    )
    over = server.post("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": text * 2}]})
    assert over.status_code == 400 and over.json()["error"]["type"] == "invalid_request_error"
    messages = server.post(
        "/v1/messages",
        {"model": "x", "max_tokens": 10, "messages": [{"role": "user", "content": text * 2}]},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"


def test_the_anthropic_sdk_works_with_its_default_version_header(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, _strict_response_validation=True)
    message = client.messages.create(model="x", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens <= 3
    assert client.messages.count_tokens(model="x", messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0
    old = server.post(
        "/v1/messages",
        {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"anthropic-version": "2023-01-01"},
    )
    assert old.status_code == 400
    assert old.json()["type"] == "error" and old.json()["error"]["type"] == "invalid_request_error"
