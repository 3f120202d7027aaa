"""OpenAI Responses codec against a fake engine: decoding, output mapping, objects and SSE.

Response objects and stream events are checked against the OpenAI OpenAPI schema and
parsed by the official SDK's types in strict mode.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from helios.frontend.events import Accumulator, FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.generate import Usage
from helios.frontend.grammar import CompiledGrammar
from helios.frontend.inference import (
    Conversation,
    ReasoningPart,
    RequestError,
    Termination,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.frontend.output import Alternative, TokenEntry
from helios.protocols.openai_responses import (
    OutputValidationError,
    ResponsesStream,
    call_item,
    custom_call,
    decode,
    response_json,
    sse,
)

SPEC_PATH = Path(__file__).resolve().parents[3] / "shared" / "spec" / "external" / "openai-openapi.nullable-fixed.json"
APPLY_PATCH = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
"""
PATCH = "*** Begin Patch\n*** Update File: app.py\n@@ def main():\n-    return 1\n+    return 2\n*** End Patch"
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
APPLY = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH},
}
NOTES = {"type": "custom", "name": "note"}  # free-form text
MCP = {
    "type": "namespace",
    "name": "mcp",
    "description": "Docs server.",
    "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
        {
            "type": "custom",
            "name": "ticket",
            "format": {"type": "grammar", "syntax": "regex", "definition": r"[A-Z]+-\d+"},
        },
    ],
}
TOOLS = [SHELL, APPLY, NOTES, MCP]


def codex_body(**extra: Any) -> dict[str, Any]:
    """A Codex-shaped request: several replayed turns of reasoning, function, custom and namespaced calls."""
    body: dict[str, Any] = {
        "model": "local",
        "instructions": "You are a coding agent.",
        "store": False,
        "stream": True,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix app.py"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "encrypted_content": None,
                "content": [{"type": "reasoning_text", "text": "Look first."}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "shell",
                "arguments": '{"command":["cat","app.py"]}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "def main():\n    return 1\n"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Patch it."}]},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": PATCH},
            {
                "type": "custom_tool_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "Done"}],
            },
            {"type": "function_call", "call_id": "call_3", "namespace": "mcp", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_3", "output": "no docs"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]},
            {"role": "user", "content": "Thanks; now run the tests."},
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {"verbosity": "low"},
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "top_logprobs": 2,
        "prompt_cache_key": "session-1",
        "max_output_tokens": 512,
        "temperature": 0.7,
    }
    return {**body, **extra}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    if not SPEC_PATH.exists():
        pytest.skip("OpenAI OpenAPI spec not present")
    return json.loads(SPEC_PATH.read_text())


def validate(spec: dict[str, Any], name: str, payload: dict[str, Any]) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(payload)


def check_response(spec: dict[str, Any], body: dict[str, Any]) -> Response:
    validate(spec, "Response", body)
    return Response.model_validate(body, strict=True)


# ---------------------------------------------------------------------------- decode
def test_decode_codex_shaped_request() -> None:
    request, options = decode(codex_body())
    conversation = request.input
    assert isinstance(conversation, Conversation)
    roles = [m.role for m in conversation.messages]
    assert roles == [
        "developer",
        "developer",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert conversation.messages[0].text() == "You are a coding agent."  # instructions lead, as developer text
    first_turn = conversation.messages[3].parts
    assert first_turn == (ReasoningPart("Look first."), ToolCallPart("call_1", "shell", '{"command":["cat","app.py"]}'))
    assert conversation.messages[4].parts == (ToolResultPart("call_1", (TextPart("def main():\n    return 1\n"),)),)
    reasoning, call = conversation.messages[5].parts
    assert reasoning == ReasoningPart("Patch it.")  # summary text is readable reasoning
    assert (
        isinstance(call, ToolCallPart) and call.name == "apply_patch" and json.loads(call.arguments) == {"input": PATCH}
    )
    assert conversation.messages[7].parts[0] == ToolCallPart("call_3", "mcp__lookup", "{}")
    assert conversation.messages[9].parts == (TextPart("Fixed."),)
    assert conversation.messages[10].parts == (TextPart("Thanks; now run the tests."),)

    tools = {t.name: t for t in conversation.tools}
    assert list(tools) == ["shell", "apply_patch", "note", "mcp__lookup", "mcp__ticket"]
    assert tools["shell"].kind == "function" and tools["shell"].parameters == SHELL["parameters"]
    patch_tool = tools["apply_patch"]
    assert patch_tool.kind == "custom" and isinstance(patch_tool.grammar, CompiledGrammar)
    assert patch_tool.parameters == {
        "type": "object",
        "properties": {"input": {"type": "string"}},
        "required": ["input"],
    }
    assert patch_tool.description is not None and "Edit files." in patch_tool.description
    assert "Lark grammar" in patch_tool.description and "begin_patch hunk+ end_patch" in patch_tool.description
    assert tools["note"].grammar is None and "`input`" in (tools["note"].description or "")
    assert "Docs server." in (tools["mcp__lookup"].description or "")
    assert conversation.tool_choice == ToolChoice(mode="auto", parallel=False)
    assert conversation.effort == "high"
    assert request.logprobs.top == 2 and request.max_tokens == 512 and request.stream
    assert request.sampling.temperature == 0.7 and request.sampling.top_k is None

    assert options.logprobs and options.top_logprobs == 2 and options.stream and options.model == "local"
    assert set(options.custom_tools) == {"apply_patch", "note", "mcp__ticket"} and options.custom_tools["note"] is None
    assert options.namespaces == {"mcp__lookup": ("mcp", "lookup"), "mcp__ticket": ("mcp", "ticket")}
    assert options.instructions == "You are a coding agent." and options.reasoning_effort == "high"
    assert options.tools_echo[0] == SHELL and options.tools_echo[3]["tools"][0]["strict"] is None


def test_decode_minimal_forms() -> None:
    request, options = decode({"model": "m", "input": "hi", "truncation": "disabled", "background": False})
    assert request.input.messages[0].role == "user" and request.input.messages[0].text() == "hi"  # type: ignore[union-attr]
    assert request.logprobs.top is None and not options.logprobs and not request.stream
    assert request.input.tool_choice == ToolChoice()  # type: ignore[union-attr]
    request, _ = decode(
        {
            "model": "m",
            "input": [
                {"role": "assistant", "content": "prefill"},
                {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
            ],
        }
    )
    assert [m.role for m in request.input.messages] == ["assistant", "user"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "custom", "name": "apply_patch"}, ToolChoice("named", "apply_patch")),
        ({"type": "function", "name": "mcp__lookup"}, ToolChoice("named", "mcp__lookup")),
        ({"type": "custom", "name": "mcp__ticket"}, ToolChoice("named", "mcp__ticket")),
        ("required", ToolChoice("required")),
        ("none", ToolChoice("none")),
    ],
)
def test_tool_choice(choice: Any, expected: ToolChoice) -> None:
    request, options = decode(codex_body(tool_choice=choice, parallel_tool_calls=None))
    assert request.input.tool_choice == expected  # type: ignore[union-attr]
    assert options.tool_choice_echo == choice


def _without_tools(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "tools"}


REJECTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"model": None}, "model", "model is required"),
    ({"store": True}, "store", "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "not supported"),
    (
        {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}]},
        "input[0]",
        "opaque encrypted reasoning is not supported",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        "input[0]",
        "data URL",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]", "input_file"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]", "role"),
    ({"input": []}, "input", "nonempty"),
    ({"tools": [{**SHELL, "strict": True}]}, "tools[0]", "strict"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "hosted"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]", "hosted"),
    (
        {"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]},
        "tools[0]",
        "hosted",
    ),
    ({"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools[0]", "hosted"),
    ({"tools": [{"type": "image_generation"}]}, "tools[0]", "hosted"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0]", "hosted"),
    ({"tools": [{"type": "local_shell"}]}, "tools[0]", "hosted"),
    (
        {"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
        "tools[0].tools[0]",
        "hosted",
    ),
    (
        {"tools": [SHELL, {**APPLY, "format": {"type": "grammar", "syntax": "lark", "definition": "start: nope"}}]},
        "tools[1].format",
        "unknown name",
    ),
    (
        {"tools": [{**APPLY, "format": {"type": "grammar", "syntax": "peg", "definition": "x"}}]},
        "tools[0].format",
        "syntax",
    ),
    (
        {"tools": [{**APPLY, "format": {"type": "grammar", "syntax": "regex", "definition": "a" * 70000}}]},
        "tools[0].format",
        "limit",
    ),
    ({"tools": [{**SHELL, "name": "mcp__lookup"}, MCP]}, "tools[1].tools[0]", "ambiguous"),
    ({"tools": [SHELL, SHELL]}, "tools[1]", "ambiguous"),
    ({"tool_choice": {"type": "function", "name": "apply_patch"}}, "tool_choice", "not declared as a function"),
    ({"tool_choice": {"type": "custom", "name": "shell"}}, "tool_choice", "not declared as a custom"),
    ({"tool_choice": {"type": "function", "name": "lookup"}}, "tool_choice", "not declared"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "tool_choice must be"),
    ({"reasoning": {"effort": 80}}, "reasoning.effort", "named level"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "named level"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": [1]}}}, "text.format.schema", "schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"text": {"format": {"type": "grammar", "syntax": "peg", "definition": "x"}}}, "text.format.syntax", "lark"),
    ({"top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"include": [], "top_logprobs": 2}, "top_logprobs", "requires include"),
    ({"include": "message.output_text.logprobs"}, "include", "array"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"instructions": ["x"]}, "instructions", "string"),
]


@pytest.mark.parametrize(("patch", "param", "needle"), REJECTIONS)
def test_rejections_name_their_field(patch: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(RequestError) as info:
        decode(codex_body(**patch))
    assert info.value.param == param
    assert needle in info.value.message


def test_required_tool_choice_needs_tools() -> None:
    with pytest.raises(RequestError) as info:
        decode(_without_tools(codex_body(tool_choice="required")))
    assert info.value.param == "tool_choice"


# ---------------------------------------------------------------------------- output mapping
def test_custom_call_is_restored_and_grammar_checked() -> None:
    _, options = decode(codex_body())
    good = ToolCallEvent("call_9", "apply_patch", json.dumps({"input": PATCH}))
    assert custom_call(good, options) == {
        "type": "custom_tool_call",
        "call_id": "call_9",
        "name": "apply_patch",
        "input": PATCH,
    }
    with pytest.raises(OutputValidationError, match="does not match its lark grammar"):
        custom_call(ToolCallEvent("c", "apply_patch", json.dumps({"input": "rm -rf /"})), options)
    with pytest.raises(OutputValidationError, match="does not match"):
        custom_call(ToolCallEvent("c", "apply_patch", json.dumps({"input": PATCH + "\ntrailing"})), options)
    with pytest.raises(OutputValidationError, match="without a string input"):
        custom_call(ToolCallEvent("c", "apply_patch", '{"patch": "x"}'), options)
    free = custom_call(ToolCallEvent("c", "note", '{"input": "anything at all"}'), options)
    assert free["input"] == "anything at all"


def test_namespaced_calls_regain_their_namespace() -> None:
    _, options = decode(codex_body())
    item = call_item(ToolCallEvent("c1", "mcp__lookup", '{"q": "x"}'), options, "fc_1")
    assert item == {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "c1",
        "name": "lookup",
        "namespace": "mcp",
        "arguments": '{"q": "x"}',
        "status": "completed",
    }
    ticket = call_item(ToolCallEvent("c2", "mcp__ticket", '{"input": "ABC-12"}'), options, "ctc_2")
    assert ticket["type"] == "custom_tool_call" and ticket["name"] == "ticket" and ticket["namespace"] == "mcp"
    with pytest.raises(OutputValidationError):
        call_item(ToolCallEvent("c3", "mcp__ticket", '{"input": "abc-12"}'), options, "ctc_3")
    unknown = call_item(ToolCallEvent("c4", "grep", "{}"), options, "fc_4")  # undeclared: returned as generated
    assert unknown["name"] == "grep" and "namespace" not in unknown


# ---------------------------------------------------------------------------- response objects
def entry(text: str, logprob: float = -0.5) -> TokenEntry:
    data = tuple(text.encode())
    return TokenEntry(1, text, data, logprob, (Alternative(1, text, data, logprob), Alternative(2, "?", (63,), -3.0)))


def agent_events() -> list[SemanticEvent]:
    return [
        ReasoningEvent("I should "),
        ReasoningEvent("patch."),
        TextEvent("Here", (entry("Here"),)),
        TextEvent(" it is.", (entry(" it"), entry(" is."))),
        ToolCallEvent("call_a", "shell", '{"command":["pytest"]}'),
        ToolCallEvent("call_b", "apply_patch", json.dumps({"input": PATCH})),
        ToolCallEvent("call_c", "mcp__lookup", "{}"),
        TextEvent("Done."),
    ]


def accumulate(events: list[SemanticEvent]) -> Accumulator:
    acc = Accumulator()
    for event in events:
        acc.push(event)
    return acc


USAGE = Usage(prompt_tokens=100, completion_tokens=40, cached_tokens=64, reasoning_tokens=5)
MODEL = "flare-model"  # the loaded model's public id, not the request's model string


def test_completed_response(spec: dict[str, Any]) -> None:
    _, options = decode(codex_body())
    acc = accumulate(agent_events() + [FinishEvent(Termination.TOOL_CALLS)])
    body = response_json("resp_x1", 1700000000, acc, USAGE, options, "completed", model=MODEL)
    parsed = check_response(spec, body)
    assert [i["type"] for i in body["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
        "function_call",
        "message",
    ]
    assert [i["id"] for i in body["output"]] == ["rs_x1_0", "msg_x1_1", "fc_x1_2", "ctc_x1_3", "fc_x1_4", "msg_x1_5"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "I should patch."}]
    assert body["output"][0]["summary"] == []
    text = body["output"][1]["content"][0]
    assert text["text"] == "Here it is." and [e["token"] for e in text["logprobs"]] == ["Here", " it", " is."]
    assert text["logprobs"][0]["top_logprobs"][1] == {"token": "?", "logprob": -3.0, "bytes": [63]}
    assert body["output"][3]["input"] == PATCH and body["output"][4]["namespace"] == "mcp"
    assert body["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
        "output_tokens": 40,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 140,
    }
    assert body["status"] == "completed" and body["error"] is None and body["store"] is False
    assert body["model"] == MODEL != options.model  # the loaded model answers, whatever the request named
    assert body["tools"] == options.tools_echo and body["parallel_tool_calls"] is False
    assert body["reasoning"]["effort"] == "high" and body["max_output_tokens"] == 512 and body["temperature"] == 0.7
    assert parsed.output_text == "Here it is.Done."


def test_incomplete_response(spec: dict[str, Any]) -> None:
    _, options = decode({"model": "m", "input": "hi", "max_output_tokens": 3})
    acc = accumulate([TextEvent("Once upon"), FinishEvent(Termination.LENGTH)])
    body = response_json("resp_2", 1700000000, acc, USAGE, options, "incomplete", model=MODEL)
    check_response(spec, body)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["completed_at"] is None
    assert body["output"][0]["status"] == "incomplete" and body["output"][0]["content"][0]["logprobs"] == []


def test_failed_response_drops_invalid_calls(spec: dict[str, Any]) -> None:
    _, options = decode(codex_body())
    bad = ToolCallEvent("call_z", "apply_patch", json.dumps({"input": "not a patch"}))
    acc = accumulate([TextEvent("Trying."), bad, FinishEvent(Termination.ERROR, error="engine failed")])
    with pytest.raises(OutputValidationError):
        response_json("resp_3", 1700000000, acc, USAGE, options, "completed", model=MODEL)
    body = response_json("resp_3", 1700000000, acc, USAGE, options, "failed", "engine failed", model=MODEL)
    check_response(spec, body)
    assert body["error"] == {"code": "server_error", "message": "engine failed"}
    assert [i["type"] for i in body["output"]] == ["message"]


# ---------------------------------------------------------------------------- streaming
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def check_stream(spec: dict[str, Any], events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        validate(spec, "ResponseStreamEvent", event)
        STREAM_EVENT.validate_python(event, strict=True)
        frame = sse(event)
        assert frame.startswith(f"event: {event['type']}\ndata: ".encode()) and frame.endswith(b"\n\n")
        assert json.loads(frame.split(b"data: ", 1)[1]) == event


def run_stream(
    events: list[SemanticEvent], batches: list[int], finish: FinishEvent, options: Any
) -> list[dict[str, Any]]:
    stream = ResponsesStream("resp_s", 1700000000, options, model=MODEL)
    out = stream.start()
    start = 0
    for size in batches + [len(events)]:
        out += stream.push(events[start : start + size])
        start += size
    return out + stream.finish(finish, accumulate(events + [finish]), USAGE)


def test_stream_event_sequence(spec: dict[str, Any]) -> None:
    _, options = decode(codex_body())
    events = run_stream(agent_events(), [1, 2, 1, 3], FinishEvent(Termination.TOOL_CALLS), options)
    check_stream(spec, events)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
    ]
    assert "response.function_call_arguments.done" in kinds and "response.custom_tool_call_input.done" in kinds
    assert not any(k == "response.output_text.delta" and e.get("delta") == "[DONE]" for k, e in zip(kinds, events))
    final = events[-1]["response"]
    Response.model_validate(final, strict=True)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert done == final["output"] and added == [i["id"] for i in done]  # stream and final object agree
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == ["Here", " it is.", "Done."]
    assert [len(e["logprobs"]) for e in deltas] == [1, 2, 0]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 5


def test_streaming_equals_buffered_over_random_batches() -> None:
    _, options = decode(codex_body())
    events = agent_events()
    finish = FinishEvent(Termination.EOS)
    expected = response_json(
        "resp_s", 1700000000, accumulate(events + [finish]), USAGE, options, "completed", model=MODEL
    )
    rng = random.Random(7)
    for _ in range(30):
        batches = [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
        out = run_stream(events, batches, finish, options)
        done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
        assert done == expected["output"]
        text = "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")
        assert text == "Here it is.Done."


def test_stream_incomplete(spec: dict[str, Any]) -> None:
    _, options = decode({"model": "m", "input": "hi", "include": ["message.output_text.logprobs"]})
    events = run_stream([TextEvent("Once", (entry("Once"),))], [], FinishEvent(Termination.LENGTH), options)
    check_stream(spec, events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    item_done = next(e for e in events if e["type"] == "response.output_item.done")
    assert item_done["item"]["status"] == "incomplete" and item_done["item"] == events[-1]["response"]["output"][0]
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == "Once" and text_done["logprobs"][0]["token"] == "Once"


def test_stream_fails_before_emitting_an_invalid_call(spec: dict[str, Any]) -> None:
    _, options = decode(codex_body())
    stream = ResponsesStream("resp_f", 1700000000, options, model=MODEL)
    out = stream.start() + stream.push([TextEvent("Patching.")])
    bad = ToolCallEvent("call_z", "apply_patch", json.dumps({"input": "not a patch"}))
    with pytest.raises(OutputValidationError):
        stream.push([TextEvent(" more"), bad])
    out += stream.error("custom tool 'apply_patch' input does not match its lark grammar")
    check_stream(spec, out)  # sequence numbers stay contiguous: the failed batch emitted nothing
    final = out[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"]["code"] == "server_error"
    assert [i["type"] for i in final["response"]["output"]] == ["message"]
    assert final["response"]["output"][0]["content"][0]["text"] == "Patching."
    check_response(spec, final["response"])


def test_stream_failure_from_the_engine(spec: dict[str, Any]) -> None:
    _, options = decode({"model": "m", "input": "hi"})
    events = run_stream([ReasoningEvent("hmm")], [], FinishEvent(Termination.ERROR, error="device lost"), options)
    check_stream(spec, events)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "device lost"
