"""Anthropic Messages through the official SDK (strict validation), on a scripted model."""

from __future__ import annotations

import anthropic
import pytest
from scripted import scripted_app

from helios.protocols.anthropic_messages import thinking_signature

KEY = "sk-ant-local"
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def app(qwen3_core):
    with scripted_app(qwen3_core, api_key=KEY) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(app) -> anthropic.Anthropic:
    # spec/api.md pins anthropic-version 2023-06-01; this SDK release defaults to a newer value.
    return anthropic.Anthropic(
        base_url=app.url,
        api_key=KEY,
        default_headers={"anthropic-version": "2023-06-01"},
        _strict_response_validation=True,
        max_retries=0,
    )


def claude_code_request(**extra) -> dict:
    """Shaped like Claude Code's requests: system blocks with cache_control, an inline system
    message, tools, a replayed thinking block, and tool_use/tool_result history."""
    return dict(
        model="claude-sonnet-4-5",
        max_tokens=400,
        system=[{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        tools=[WEATHER],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "Need the tool.",
                        "signature": thinking_signature("Need the tool."),
                    },
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "sunny",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
            {"role": "system", "content": "Answer in one sentence."},
        ],
        **extra,
    )


def test_create_with_thinking_and_text(app, sdk: anthropic.Anthropic) -> None:
    app.say("<think>It is sunny.</think>It is sunny in Paris.")
    message = sdk.messages.create(**claude_code_request(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "It is sunny." and message.content[0].signature.startswith(
        "flare-thinking-v1:"
    )
    assert message.content[1].text == "It is sunny in Paris." and message.stop_reason == "end_turn"
    counted = sdk.messages.count_tokens(**{k: v for k, v in claude_code_request().items() if k != "max_tokens"})
    usage = message.usage
    assert usage.cache_creation_input_tokens == 0
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    # The same conversation again reuses the prompt's cached pages.
    app.say("Sunny.")
    again = sdk.messages.create(**claude_code_request())
    assert again.usage.cache_read_input_tokens > 0
    assert counted.input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens


def test_tool_use(app, sdk: anthropic.Anthropic) -> None:
    app.say(CALL)
    message = sdk.messages.create(
        model="m", max_tokens=400, tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Paris?"}]
    )
    assert message.stop_reason == "tool_use"
    block = message.content[-1]
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}


def test_stream_events(app, sdk: anthropic.Anthropic) -> None:
    app.say("<think>Plan.</think>Done." + CALL)
    with sdk.messages.stream(
        model="m", max_tokens=400, tools=[WEATHER], messages=[{"role": "user", "content": "Go"}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].signature == thinking_signature("Plan.") and final.stop_reason == "tool_use"


def test_stop_reasons(app, sdk: anthropic.Anthropic) -> None:
    app.say("one two three four")
    stopped = sdk.messages.create(
        model="m", max_tokens=100, stop_sequences=["three"], messages=[{"role": "user", "content": "count"}]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert stopped.content[0].text == "one two "
    app.say("one two three four")
    limited = sdk.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert limited.stop_reason == "max_tokens" and limited.usage.output_tokens == 3


def test_errors_use_the_messages_format(app) -> None:
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    missing = app.post("/v1/messages", json=base, headers={"x-api-key": KEY})
    assert missing.status_code == 400 and missing.json()["type"] == "error"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert (
        app.post("/v1/messages", json=base, headers={"anthropic-version": "2023-06-01"}).json()["error"]["type"]
        == "authentication_error"
    )
    both = {**headers, "authorization": "Bearer wrong"}
    assert app.post("/v1/messages", json=base, headers=both).status_code == 401
    assert app.post("/v1/messages", json=base, headers={**headers, "authorization": f"Bearer {KEY}"}).status_code == 200
    for field in ("logprobs", "top_logprobs", "logprob_token_ids", "return_tokens_as_token_ids"):
        rejected = app.post("/v1/messages", json={**base, field: 1}, headers=headers)
        assert rejected.status_code == 400 and field in rejected.json()["error"]["message"]
    tampered = claude_code_request()
    tampered["messages"][1]["content"][0]["thinking"] = "Something else."
    assert app.post("/v1/messages", json=tampered, headers=headers).status_code == 400
