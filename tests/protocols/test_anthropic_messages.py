"""Anthropic Messages codec: request decoding, rejections, and message / SSE encoding.

Every emitted body is checked against the hosted OpenAPI schemas and parsed by the official
SDK in strict mode; streams are also replayed through the SDK's own stream accumulator.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import anthropic
import httpx2  # the transport package this anthropic SDK is built on (not httpx)
import jsonschema
import pytest
from pydantic import TypeAdapter
from support import ANTHROPIC_SPEC, anthropic_spec

from helios.frontend.events import Accumulator, FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.generate import Usage
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    Message,
    ReasoningPart,
    RequestError,
    Termination,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from helios.protocols.anthropic_messages import (
    MessagesStream,
    count_tokens_decode,
    decode,
    message_json,
    sse,
    stop_reason,
    thinking_signature,
    usage_json,
)
from helios.server.errors import anthropic_error

VERSION = "2023-06-01"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
EVENT_ADAPTER = TypeAdapter(anthropic.types.RawMessageStreamEvent)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    if not ANTHROPIC_SPEC.exists():
        pytest.skip("Anthropic hosted spec not present")
    return anthropic_spec()


def spec_validate(spec: dict[str, Any], name: str, payload: dict[str, Any]) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(payload)


def _mapping(spec: dict[str, Any], event: str, field: str) -> set[str]:
    return set(spec["components"]["schemas"][event]["properties"][field]["discriminator"]["mapping"])


def check_message(spec: dict[str, Any], body: dict[str, Any]) -> None:
    """SDK strict parse of the whole message; the spec (which predates thinking) checks the
    envelope and every block type it knows."""
    anthropic.types.Message.model_validate(body, strict=True)
    known = set(spec["components"]["schemas"]["ContentBlock"]["discriminator"]["mapping"])
    assert {b["type"] for b in body["content"]} <= known | {"thinking"}
    spec_validate(spec, "Message", {**body, "content": [b for b in body["content"] if b["type"] in known]})


def check_event(spec: dict[str, Any], name: str, data: dict[str, Any]) -> None:
    assert data["type"] == name
    if name == "ping":
        assert data == {"type": "ping"}  # no schema: the SDK skips pings
        return
    if name == "error":
        spec_validate(spec, "ErrorResponse", data)
        return
    EVENT_ADAPTER.validate_python(data, strict=True)
    block = data.get("content_block", {}).get("type")
    delta = data.get("delta", {}).get("type") if name == "content_block_delta" else None
    if block is not None and block not in _mapping(spec, "ContentBlockStartEvent", "content_block"):
        assert block == "thinking"
    elif delta is not None and delta not in _mapping(spec, "ContentBlockDeltaEvent", "delta"):
        assert delta in ("thinking_delta", "signature_delta")
    elif name == "message_start":
        spec_validate(spec, "MessageStartEvent", data)
    else:
        spec_validate(spec, "MessageStreamEvent", data)


def sdk_client(handler: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="k",
        base_url="http://flare.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        _strict_response_validation=True,
    )


# ---------------------------------------------------------------------------- decoding
def body(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **fields}


def claude_code_body() -> dict[str, Any]:
    mine = "I should list the files."
    cached = {"type": "ephemeral"}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "stop_sequences": ["\n\nHuman:"],
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": cached},
            {"type": "text", "text": "Be brief.", "cache_control": cached},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}},
            {"type": "custom", "name": "Read", "input_schema": {"type": "object"}, "cache_control": cached},
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 16000},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list files", "cache_control": cached}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": mine, "signature": thinking_signature(mine)},
                    {"type": "thinking", "thinking": "their thoughts", "signature": "EqQBCkYIBxgCKkB..."},
                    {"type": "text", "text": "Listing.", "cache_control": cached},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "ä"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt", "cache_control": cached},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "denied"},
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                        ],
                    },
                    {"type": "text", "text": "<system-reminder>todo</system-reminder>", "cache_control": cached},
                ],
            },
            {"role": "system", "content": "Inline note."},
            {"role": "user", "content": "go on"},
        ],
    }


def test_claude_code_request_decodes_to_the_neutral_conversation() -> None:
    request, options = decode(claude_code_body(), headers_version=VERSION)
    conversation = request.input
    assert isinstance(conversation, Conversation)
    image = ImagePart(b"\x89PNG\r\n\x1a\nfake", "image/png")
    assert conversation.messages == (
        Message("system", (TextPart("You are Claude Code."), TextPart("Be brief."))),
        Message("user", (TextPart("list files"),)),
        Message(
            "assistant",
            (
                ReasoningPart("I should list the files."),
                ReasoningPart("their thoughts"),
                TextPart("Listing."),
                ToolCallPart("toolu_1", "Bash", '{"command": "ls"}'),
                ToolCallPart("toolu_2", "Read", '{"path": "ä"}'),
            ),
        ),
        Message("tool", (ToolResultPart("toolu_1", (TextPart("a.txt"),)),)),
        Message("tool", (ToolResultPart("toolu_2", (TextPart("denied"), image), is_error=True),)),
        Message("user", (TextPart("<system-reminder>todo</system-reminder>"),)),
        Message("system", (TextPart("Inline note."),)),
        Message("user", (TextPart("go on"),)),
    )
    assert conversation.tools == (
        ToolSpec("Bash", "Run a command", {"type": "object"}),
        ToolSpec("Read", None, {"type": "object"}),
    )
    assert conversation.tool_choice == ToolChoice("auto", None, parallel=False)
    assert conversation.thinking is True and conversation.effort == "high"
    assert conversation.add_generation_prompt and not conversation.continue_final_message
    assert request.max_tokens == 32000 and request.n == 1 and request.stream
    assert request.thinking_token_budget == 16000
    assert request.stop.strings == ("\n\nHuman:",)
    assert request.sampling.temperature == 1 and request.sampling.top_k is None
    assert options.model == "claude-sonnet-4-5" and options.stream
    assert (options.thinking_enabled, options.budget, options.effort) == (True, 16000, "high")
    # user text, first tool result, the reminder after the tool messages; system/assistant markers ignored
    assert conversation.cache_marks == ((1, 0), (3, 0), (5, 0))


def test_cache_boundaries_keep_the_first_four_user_blocks() -> None:
    cached = {"type": "ephemeral"}
    blocks = [{"type": "text", "text": str(i), "cache_control": cached} for i in range(6)]
    request, _ = decode(body(messages=[{"role": "user", "content": blocks}]), headers_version=VERSION)
    assert request.input.cache_marks == ((0, 0), (0, 1), (0, 2), (0, 3))


def test_empty_system_produces_nothing_and_prefill_continues() -> None:
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "The answer is"},
    ]
    for system in ("", []):
        request, _ = decode(body(system=system, messages=messages), headers_version=VERSION)
        conversation = request.input
        assert isinstance(conversation, Conversation)
        assert [m.role for m in conversation.messages] == ["user", "assistant"]
        assert conversation.continue_final_message and not conversation.add_generation_prompt


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ToolChoice("auto")),
        ({"type": "any"}, ToolChoice("required")),
        ({"type": "tool", "name": "lookup", "disable_parallel_tool_use": True}, ToolChoice("named", "lookup", False)),
        ({"type": "none"}, ToolChoice("none")),
    ],
)
def test_tool_choice_modes(choice: dict[str, Any], expected: ToolChoice) -> None:
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
    request, _ = decode(body(tools=tools, tool_choice=choice), headers_version=VERSION)
    assert isinstance(request.input, Conversation) and request.input.tool_choice == expected


@pytest.mark.parametrize(
    ("fields", "budget", "applied", "effort", "thinking"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 5000}}, 5000, 5000, "low", True),
        ({"thinking": {"type": "enabled", "budget_tokens": 5001}}, 5001, 5001, "high", True),
        ({"thinking": {"type": "enabled", "budget_tokens": 20000}}, 20000, 20000, "high", True),
        ({"thinking": {"type": "adaptive", "budget_tokens": 20001}}, 20001, 20001, "max", True),
        ({"thinking": {"type": "adaptive"}}, None, None, None, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 2**40}}, 2**40, None, "max", True),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "medium"}},
            1024,
            1024,
            "medium",
            True,
        ),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 9000}, "thinking_token_budget": 9000},
            9000,
            9000,
            "high",
            True,
        ),
        ({"thinking_token_budget": 100}, 100, 100, "low", None),
        ({"thinking": {"type": "disabled"}}, None, None, None, False),
    ],
)
def test_thinking_budget_and_effort(
    fields: dict[str, Any], budget: int | None, applied: int | None, effort: str | None, thinking: bool | None
) -> None:
    request, options = decode(body(**fields), headers_version=VERSION)
    assert (options.budget, request.thinking_token_budget, options.effort) == (budget, applied, effort)
    assert isinstance(request.input, Conversation)
    assert request.input.thinking is thinking and options.thinking_enabled is thinking
    assert request.input.effort == effort
    assert options.explicit_budget is ("thinking_token_budget" in fields)  # else budget_tokens may be only a hint
    assert request.budget_is_hint is (
        "thinking_token_budget" not in fields
    )  # the frontend drops it where it cannot cap


def test_count_tokens_needs_no_max_tokens() -> None:
    raw = claude_code_body()
    del raw["max_tokens"]
    conversation, output = count_tokens_decode(raw, VERSION)
    assert conversation == decode(claude_code_body(), headers_version=VERSION)[0].input and output is None
    with pytest.raises(RequestError):
        count_tokens_decode(raw, None)


@pytest.mark.parametrize("version", [None, "2023-05-31", ""])
def test_anthropic_version_is_required(version: str | None) -> None:
    with pytest.raises(RequestError) as error:
        decode(body(), headers_version=version)
    assert error.value.param is None and "anthropic-version" in error.value.message


def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def _assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": list(blocks)}]}


def _image(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


REJECTIONS = [
    ({"model": None}, "model", "model"),
    ({"max_tokens": None}, "max_tokens", "max_tokens"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": True}, "max_tokens", "max_tokens"),
    ({"messages": []}, "messages", "nonempty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role"),
    (_user(_image({"type": "url", "url": "https://x/a.png"})), "messages", "base64"),
    (_user(_image({"type": "base64", "media_type": "image/gif", "data": PNG})), "messages", "image/gif"),
    (_user(_image({"type": "base64", "media_type": "image/png", "data": "%%%"})), "messages", "base64"),
    (_user({"type": "document", "source": {"type": "text", "data": "x"}}), "messages", "document"),
    (_user({"type": "search_result", "source": "s", "title": "t", "content": []}), "messages", "search_result"),
    (_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}), "messages", "document"),
    (_assistant({"type": "redacted_thinking", "data": "opaque"}), "messages", "redacted_thinking"),
    (
        _assistant({"type": "thinking", "thinking": "edited", "signature": thinking_signature("original")}),
        "messages",
        "thinking block was modified",
    ),
    (
        _assistant({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}),
        "messages",
        "server_tool_use",
    ),
    ({"system": [{"type": "image"}]}, "system", "text"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "web_search_20250305"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools", "bash_20250124"),
    ({"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]}, "tools", "text_editor"),
    ({"tools": [{"type": "computer_20250124", "name": "computer"}]}, "tools", "computer"),
    ({"tools": [{"name": "t"}]}, "tools", "input_schema"),
    (
        {"tools": [{"name": "t", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "u"}},
        "tool_choice",
        "'u'",
    ),
    ({"tool_choice": {"type": "required"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "at least one declared tool"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "budget_tokens"),
    ({"thinking": {"type": "on"}}, "thinking", "thinking.type"),
    ({"thinking": {"type": "adaptive", "budget_tokens": "4k"}}, "thinking.budget_tokens", "positive integer"),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 2000}, "thinking_token_budget": 3000},
        "thinking_token_budget",
        "must match",
    ),
    ({"output_config": {"effort": 80}}, "output_config.effort", "numeric"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort", "named level"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management", "active"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}, "context_management", "active"),
    ({"stop_sequences": "END"}, "stop_sequences", "array"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"top_logprobs": 5}, "top_logprobs", "top_logprobs"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "return_tokens_as_token_ids"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids", "logprob_token_ids"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs"),
]


@pytest.mark.parametrize(("fields", "param", "words"), REJECTIONS)
def test_rejections_name_their_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(RequestError) as error:
        decode(body(**fields), headers_version=VERSION)
    assert error.value.param == param
    assert words in error.value.message


# ---------------------------------------------------------------------------- encoding
@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        (FinishEvent(Termination.LENGTH), ("max_tokens", None)),
        (FinishEvent(Termination.TOOL_CALLS), ("tool_use", None)),
        (FinishEvent(Termination.STOP_STRING, matched_stop="END"), ("stop_sequence", "END")),
        (FinishEvent(Termination.EOS), ("end_turn", None)),
        (FinishEvent(Termination.STOP_TOKEN), ("end_turn", None)),
        (FinishEvent(Termination.ABORT), ("end_turn", None)),
    ],
)
def test_stop_reason_table(finish: FinishEvent, expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish) == expected


def test_usage_splits_cache_reads_from_input() -> None:
    assert usage_json(Usage(prompt_tokens=120, completion_tokens=7, cached_tokens=100)) == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 100,
        "output_tokens": 7,
    }


def test_sse_frame() -> None:
    assert sse("ping", {"type": "ping", "x": "ä"}) == 'event: ping\ndata: {"type":"ping","x":"ä"}\n\n'.encode()


CALL = ToolCallEvent("call_00000000002a", "lookup", '{"q": "flare", "n": 2}')
USAGE = Usage(prompt_tokens=30, completion_tokens=12, cached_tokens=16)
CASES = {
    "reasoning_text": (
        [
            [ReasoningEvent("Let me "), ReasoningEvent("think.")],
            [TextEvent("Hel"), TextEvent("")],
            [TextEvent("lo"), FinishEvent(Termination.EOS)],
        ],
        [
            "thinking",
            "thinking_delta",
            "thinking_delta",
            "signature_delta",
            "stop",
            "text",
            "text_delta",
            "text_delta",
            "stop",
        ],
    ),
    "text_tool": (
        [[TextEvent("Looking up.")], [CALL, FinishEvent(Termination.TOOL_CALLS)]],
        ["text", "text_delta", "stop", "tool_use", "input_json_delta", "stop"],
    ),
    "empty": ([[FinishEvent(Termination.LENGTH)]], []),
}


def _shape(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Block lifecycle in brief: block start type, delta type, or "stop"."""
    out = []
    for name, data in events:
        if name == "content_block_start":
            out.append(data["content_block"]["type"])
        elif name == "content_block_delta":
            out.append(data["delta"]["type"])
        elif name == "content_block_stop":
            out.append("stop")
    return out


def _run_stream(pushes: list[list[SemanticEvent]]) -> tuple[list[tuple[str, dict[str, Any]]], Accumulator]:
    stream, acc = MessagesStream("msg_flare1", "flare-model", USAGE.prompt_tokens), Accumulator()
    events = stream.start()
    for batch in pushes:
        events += stream.push(batch)
        for event in batch:
            acc.push(event)
    assert acc.finish is not None
    return events + stream.finish(acc.finish, USAGE), acc


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_events_are_valid_and_match_the_buffered_message(spec: dict[str, Any], case: str) -> None:
    pushes, shape = CASES[case]
    events, acc = _run_stream(pushes)
    for name, data in events:
        check_event(spec, name, data)
    assert _shape(events) == shape
    assert [name for name, _ in events[:2]] == ["message_start", "ping"]
    assert [name for name, _ in events[-2:]] == ["message_delta", "message_stop"]
    start_usage = events[0][1]["message"]["usage"]
    assert (start_usage["input_tokens"], start_usage["cache_read_input_tokens"]) == (30, 0)
    assert events[-2][1]["usage"] == usage_json(USAGE)
    indices = [data["index"] for name, data in events if name == "content_block_start"]
    assert indices == list(range(len(indices)))

    buffered = message_json("msg_flare1", "flare-model", acc, USAGE)
    check_message(spec, buffered)
    assert buffered["stop_reason"] == events[-2][1]["delta"]["stop_reason"]

    payload = b"".join(sse(name, data) for name, data in events)
    client = sdk_client(
        lambda request: httpx2.Response(200, content=payload, headers={"content-type": "text/event-stream"})
    )
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    assert final.model_dump(mode="json", exclude_none=True)["content"] == buffered["content"]
    assert final.stop_reason == buffered["stop_reason"] and final.usage.cache_read_input_tokens == 16


def test_buffered_message_parses_with_the_sdk_and_replays_its_thinking(spec: dict[str, Any]) -> None:
    acc = Accumulator()
    for event in (ReasoningEvent("Plan."), TextEvent("Done."), CALL, FinishEvent(Termination.TOOL_CALLS)):
        acc.push(event)
    buffered = message_json("msg_flare2", "flare-model", acc, USAGE)
    check_message(spec, buffered)
    assert buffered["content"] == [
        {"type": "thinking", "thinking": "Plan.", "signature": thinking_signature("Plan.")},
        {"type": "text", "text": "Done."},
        {"type": "tool_use", "id": CALL.call_id, "name": "lookup", "input": {"q": "flare", "n": 2}},
    ]
    assert (buffered["stop_reason"], buffered["usage"]["input_tokens"]) == ("tool_use", 14)
    client = sdk_client(lambda request: httpx2.Response(200, json=buffered))
    assert (
        client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]).id
        == "msg_flare2"
    )

    history = _assistant(*buffered["content"])["messages"]
    history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL.call_id, "content": "ok"}]})
    request, _ = decode(body(messages=history), headers_version=VERSION)
    assert isinstance(request.input, Conversation)
    assert request.input.messages[1].parts[0] == ReasoningPart("Plan.")
    tampered = copy.deepcopy(history)
    tampered[1]["content"][0]["thinking"] = "Plan!"
    with pytest.raises(RequestError, match="modified"):
        decode(body(messages=tampered), headers_version=VERSION)


def test_stream_error_event(spec: dict[str, Any]) -> None:
    stream = MessagesStream("msg_flare3", "flare-model", 5)
    events = stream.start() + stream.push([TextEvent("partial")]) + stream.error(500, "required tool call missing")
    assert events[-1] == ("error", anthropic_error(500, "required tool call missing"))
    assert stream.error(429, "busy")[0][1] == anthropic_error(429, "busy")
    check_event(spec, *events[-1])
    payload = b"".join(sse(name, data) for name, data in events)
    client = sdk_client(
        lambda request: httpx2.Response(200, content=payload, headers={"content-type": "text/event-stream"})
    )
    with pytest.raises(anthropic.APIStatusError, match="required tool call missing"):
        with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
            s.get_final_message()
