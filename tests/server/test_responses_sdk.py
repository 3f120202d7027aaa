"""OpenAI Responses through the official SDK (strict validation), on a scripted model."""

from __future__ import annotations

import json

import openai
import pytest

from tests.protocols.test_openai_responses import TOOLS, codex_body  # a Codex-shaped request

PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch\\n" LINE* "*** End Patch"\nLINE: /[^*\\n][^\\n]*\\n/',
    },
}


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def sdk(qwen3_app) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=qwen3_app.url + "/v1", api_key="unused", _strict_response_validation=True, max_retries=0
    )


def test_create_reasoning_and_function_call(qwen3_app, sdk: openai.OpenAI) -> None:
    qwen3_app.say("<think>Run pytest.</think>" + call("shell", {"command": ["pytest"]}))
    response = sdk.responses.create(
        model="codex-local",
        instructions="You are Codex.",
        input=codex_body()["input"],
        tools=TOOLS,
        store=False,
        max_output_tokens=300,
    )
    assert response.status == "completed"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "Run pytest." and response.output[0].summary == []
    fc = response.output[1]
    assert fc.name == "shell" and json.loads(fc.arguments) == {"command": ["pytest"]}
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_custom_tool_call_is_validated_against_its_grammar(qwen3_app, sdk: openai.OpenAI) -> None:
    good = "*** Begin Patch\nfix\n*** End Patch"
    qwen3_app.say(call("apply_patch", {"input": good}))
    response = sdk.responses.create(model="m", input="Fix it.", tools=[PATCH], store=False, max_output_tokens=300)
    item = response.output[-1]
    assert item.type == "custom_tool_call" and item.name == "apply_patch" and item.input == good
    qwen3_app.say(call("apply_patch", {"input": "not a patch"}))
    with pytest.raises(openai.InternalServerError):
        sdk.responses.create(model="m", input="Fix it.", tools=[PATCH], store=False, max_output_tokens=300)


def test_stream_lifecycle(qwen3_app, sdk: openai.OpenAI) -> None:
    qwen3_app.say("<think>Short.</think>All tests pass.")
    with sdk.responses.stream(model="m", input="Status?", store=False, max_output_tokens=200) as stream:
        events = [event for event in stream]
        final = stream.get_final_response()
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "response.output_text.delta" in [event.type for event in events]
    assert final.output_text == "All tests pass."


def test_incomplete_and_logprobs(qwen3_app, sdk: openai.OpenAI) -> None:
    qwen3_app.say("one two three four five six")
    response = sdk.responses.create(
        model="m",
        input="count",
        store=False,
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    part = response.output[-1].content[0]
    assert part.logprobs and len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


def test_stateful_features_are_refused(qwen3_app) -> None:
    for extra in ({"store": True}, {"previous_response_id": "resp_1"}, {"background": True}, {"truncation": "auto"}):
        response = qwen3_app.post("/v1/responses", json={"model": "m", "input": "hi", **extra})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    opaque = [{"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "gAAAA..."}]
    assert qwen3_app.post("/v1/responses", json={"model": "m", "input": opaque}).status_code == 400
