"""Tool choice, reasoning budgets and effort through Messages and Responses, buffered and streamed.

A scripted model (tests/server/scripted.py) writes each test's output on the real stack. Every
case runs twice, buffered and streamed: the stream is reassembled and must equal the buffered
result. Every buffered body and stream event is parsed by the official SDK in strict mode and
validated against the published schema (the hosted Anthropic spec predates thinking blocks, so
it checks the envelope and the block types it knows).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from helios.core.template import ChatTemplate
from helios.frontend.request import REQUIRED_TOOL_INSTRUCTION
from helios.protocols.anthropic_messages import thinking_signature
from scripted import ScriptedServer, scripted_app
from serving import SCHEMA_PATH, schema_validator, sse_events
from support import ANTHROPIC_SPEC, anthropic_spec

VERSION = {"anthropic-version": "2023-06-01"}
ASK = "Weather in Paris?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NOTHING = {"type": "object", "properties": {}}


def call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


CALL = call("get_weather", {"city": "Paris"})
TIME_CALL = call("get_time", {})
WEATHER_CALL = ("get_weather", {"city": "Paris"})


# ---------------------------------------------------------------------------- schemas
class Schemas:
    def __init__(self) -> None:
        self.openai = json.loads(SCHEMA_PATH.read_text())
        self.anthropic = anthropic_spec()
        names = ("Response", "ResponseStreamEvent", "ErrorResponse")
        self._openai = {n: schema_validator(self.openai, n) for n in names}
        self._anthropic: dict[str, jsonschema.protocols.Validator] = {}
        self.response_event = TypeAdapter(ResponseStreamEvent)
        self.message_event = TypeAdapter(anthropic.types.RawMessageStreamEvent)

    def openai_body(self, name: str, body: dict[str, Any]) -> None:
        self._openai[name].validate(body)

    def anthropic_body(self, name: str, body: dict[str, Any]) -> None:
        if name not in self._anthropic:
            self._anthropic[name] = schema_validator(self.anthropic, name)
        self._anthropic[name].validate(body)

    def mapping(self, schema: str, field: str) -> set[str]:
        return set(self.anthropic["components"]["schemas"][schema]["properties"][field]["discriminator"]["mapping"])

    def check_message(self, body: dict[str, Any]) -> None:
        anthropic.types.Message.model_validate(body, strict=True)
        known = set(self.anthropic["components"]["schemas"]["ContentBlock"]["discriminator"]["mapping"])
        assert {b["type"] for b in body["content"]} <= known | {"thinking"}
        self.anthropic_body("Message", {**body, "content": [b for b in body["content"] if b["type"] in known]})

    def check_message_event(self, name: str, data: dict[str, Any]) -> None:
        assert data["type"] == name
        if name == "ping":
            assert data == {"type": "ping"}
            return
        if name == "error":
            self.anthropic_body("ErrorResponse", data)
            return
        self.message_event.validate_python(data, strict=True)
        block = data.get("content_block", {}).get("type")
        delta = data.get("delta", {}).get("type") if name == "content_block_delta" else None
        if block is not None and block not in self.mapping("ContentBlockStartEvent", "content_block"):
            assert block == "thinking"
        elif delta is not None and delta not in self.mapping("ContentBlockDeltaEvent", "delta"):
            assert delta in ("thinking_delta", "signature_delta")
        elif name == "message_start":
            self.anthropic_body("MessageStartEvent", data)
        else:
            self.anthropic_body("MessageStreamEvent", data)

    def check_response(self, body: dict[str, Any]) -> None:
        self.openai_body("Response", body)
        Response.model_validate(body, strict=True)

    def check_response_event(self, event: dict[str, Any]) -> None:
        self.openai_body("ResponseStreamEvent", event)
        self.response_event.validate_python(event, strict=True)


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    if not SCHEMA_PATH.exists() or not ANTHROPIC_SPEC.exists():
        pytest.skip("the external OpenAI / Anthropic schemas are not present")
    return Schemas()


# ---------------------------------------------------------------------------- results
@dataclass
class Result:
    """One protocol answer in neutral terms, so buffered and streamed answers compare equal."""

    status: int  # HTTP status (200 for every stream)
    blocks: list[tuple] = field(default_factory=list)  # ("reasoning", text) | ("text", text) | ("call", name, args)
    stop: str | None = None  # Messages stop_reason, or Responses status
    error: str | None = None  # the error message (HTTP error body or terminal stream event)
    error_type: str | None = None  # api_error / server_error ...
    prompt_tokens: int | None = None  # Messages: input plus cache reads
    output_tokens: int | None = None
    reasoning_tokens: int | None = None  # Responses only
    body: dict[str, Any] | None = None  # the buffered body, or the reassembled stream's final object
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    streamed: Result | None = None  # set by `both` on the buffered result

    @property
    def reasoning(self) -> str:
        return "".join(b[1] for b in self.blocks if b[0] == "reasoning")

    @property
    def text(self) -> str:
        return "".join(b[1] for b in self.blocks if b[0] == "text")

    @property
    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        return [(b[1], b[2]) for b in self.blocks if b[0] == "call"]

    def same_answer(self) -> tuple:
        return self.status == 200, self.blocks, self.stop, self.prompt_tokens, self.output_tokens, self.reasoning_tokens


def _named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a named-SSE response; each data must repeat its event name."""
    out = []
    for frame in response.text.split("\n\n"):
        lines = frame.splitlines()
        names = [line[6:].strip() for line in lines if line.startswith("event:")]
        data = [line[5:].strip() for line in lines if line.startswith("data:")]
        if not data:
            continue
        payload = json.loads("\n".join(data))
        assert names == [payload["type"]], frame
        out.append((names[0], payload))
    return out


class Messages:
    """POST /v1/messages with Anthropic tool and thinking fields."""

    name = "messages"

    def __init__(self, app: ScriptedServer, schemas: Schemas) -> None:
        self.app, self.schemas = app, schemas

    @staticmethod
    def tools(*names: str) -> list[dict[str, Any]]:
        specs = {
            "get_weather": {"name": "get_weather", "description": "Weather in a city", "input_schema": CITY},
            "get_time": {"name": "get_time", "description": "The time", "input_schema": NOTHING},
        }
        return [specs[n] for n in names]

    @staticmethod
    def choice(mode: str, name: str | None = None, parallel: bool = True) -> dict[str, Any]:
        choice: dict[str, Any] = {"type": {"required": "any", "named": "tool"}.get(mode, mode)}
        if name is not None:
            choice["name"] = name
        if not parallel:
            choice["disable_parallel_tool_use"] = True
        return {"tool_choice": choice}

    def post(self, body: dict[str, Any]) -> httpx.Response:
        full = {"model": "claude-x", "max_tokens": 256, "messages": [{"role": "user", "content": ASK}], **body}
        return self.app.post("/v1/messages", json=full, headers=VERSION)

    def buffered(self, body: dict[str, Any]) -> Result:
        response = self.post(body)
        if response.status_code != 200:
            error = response.json()
            self.schemas.anthropic_body("ErrorResponse", error)
            assert error["type"] == "error"
            return Result(
                response.status_code, error=error["error"]["message"], error_type=error["error"]["type"], body=error
            )
        message = response.json()
        self.schemas.check_message(message)
        assert response.headers["x-request-id"] == message["id"]
        return self._result(message)

    def streamed(self, body: dict[str, Any]) -> Result:
        response = self.post({**body, "stream": True})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _named_events(response)
        for name, data in events:
            self.schemas.check_message_event(name, data)
        assert events[0][0] == "message_start"
        message = dict(events[0][1]["message"], content=[])
        partial: dict[int, str] = {}
        for name, data in events[1:]:
            assert message.get("done") is None, f"{name} after the terminal event"
            if name == "error":
                assert events[-1] == (name, data)  # terminal: no message_delta / message_stop after it
                assert all(n not in ("message_delta", "message_stop") for n, _ in events)
                return Result(
                    200, error=data["error"]["message"], error_type=data["error"]["type"], body=data, events=events
                )
            if name == "content_block_start":
                assert data["index"] == len(message["content"])
                message["content"].append(dict(data["content_block"]))
            elif name == "content_block_delta":
                block, delta = message["content"][data["index"]], data["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "signature_delta":
                    block["signature"] = delta["signature"]
                else:
                    partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            elif name == "content_block_stop":
                if data["index"] in partial:
                    message["content"][data["index"]]["input"] = json.loads(partial.pop(data["index"]))
            elif name == "message_delta":
                message.update(data["delta"])
                message["usage"] = {**message["usage"], **data["usage"]}
            elif name == "message_stop":
                message["done"] = True
        assert message.pop("done", None) is True and events[-1][0] == "message_stop"
        self.schemas.check_message(message)
        result = self._result(message, events)
        start = events[0][1]["message"]["usage"]  # the full prompt, before the final cache counts
        assert start["cache_read_input_tokens"] == 0 and start["input_tokens"] == result.prompt_tokens
        return result

    @staticmethod
    def _result(message: dict[str, Any], events: list | None = None) -> Result:
        blocks: list[tuple] = []
        for block in message["content"]:
            if block["type"] == "thinking":
                assert block["signature"] == thinking_signature(block["thinking"])
                blocks.append(("reasoning", block["thinking"]))
            elif block["type"] == "text":
                blocks.append(("text", block["text"]))
            else:
                assert block["type"] == "tool_use" and block["id"]
                blocks.append(("call", block["name"], block["input"]))
        usage = message["usage"]
        assert usage["cache_creation_input_tokens"] == 0
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        return Result(
            200,
            blocks,
            message["stop_reason"],
            prompt_tokens=prompt,
            output_tokens=usage["output_tokens"],
            body=message,
            events=events or [],
        )


class Responses:
    """POST /v1/responses with OpenAI Responses tool and reasoning fields."""

    name = "responses"

    def __init__(self, app: ScriptedServer, schemas: Schemas) -> None:
        self.app, self.schemas = app, schemas

    @staticmethod
    def tools(*names: str) -> list[dict[str, Any]]:
        specs = {
            "get_weather": {
                "type": "function",
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": CITY,
            },
            "get_time": {"type": "function", "name": "get_time", "description": "The time", "parameters": NOTHING},
        }
        return [specs[n] for n in names]

    @staticmethod
    def choice(mode: str, name: str | None = None, parallel: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"tool_choice": {"type": "function", "name": name} if mode == "named" else mode}
        if not parallel:
            out["parallel_tool_calls"] = False
        return out

    def post(self, body: dict[str, Any]) -> httpx.Response:
        full = {"model": "codex-x", "input": ASK, "max_output_tokens": 256, "store": False, **body}
        return self.app.post("/v1/responses", json=full)

    def buffered(self, body: dict[str, Any]) -> Result:
        response = self.post(body)
        if response.status_code != 200:
            error = response.json()
            self.schemas.openai_body("ErrorResponse", error)
            return Result(
                response.status_code, error=error["error"]["message"], error_type=error["error"]["type"], body=error
            )
        out = response.json()
        self.schemas.check_response(out)
        assert response.headers["x-request-id"] == out["id"]
        return self._result(out)

    def streamed(self, body: dict[str, Any]) -> Result:
        response = self.post({**body, "stream": True})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        named = _named_events(response)
        events = [data for _, data in named]
        assert events and events[-1]["type"] != "[DONE]" and "[DONE]" not in sse_events(response)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            self.schemas.check_response_event(event)
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        terminal = ("response.completed", "response.incomplete", "response.failed")
        assert kinds[-1] in terminal and not any(k in terminal for k in kinds[:-1])
        final = events[-1]["response"]
        self.schemas.check_response(final)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [i["id"] for i in done]
        if kinds[-1] == "response.failed":  # the items delivered before the failure
            assert final["output"] == done
            return Result(
                200,
                error=final["error"]["message"],
                error_type=final["error"]["code"],
                stop="failed",
                body=final,
                events=named,
            )
        assert final["output"] == done  # the stream's items are the final object's
        for item in done:  # each item's deltas rebuild its content
            if item["type"] in ("message", "reasoning"):
                kind = "output_text" if item["type"] == "message" else "reasoning_text"
                deltas = "".join(
                    e["delta"] for e in events if e["type"] == f"response.{kind}.delta" and e["item_id"] == item["id"]
                )
                assert deltas == item["content"][0]["text"]
            else:
                args = [
                    e
                    for e in events
                    if e["type"] == "response.function_call_arguments.done" and e["item_id"] == item["id"]
                ]
                assert [a["arguments"] for a in args] == [item["arguments"]]
        return self._result(final, named)

    @staticmethod
    def _result(body: dict[str, Any], events: list | None = None) -> Result:
        blocks: list[tuple] = []
        for item in body["output"]:
            if item["type"] == "reasoning":
                assert item["summary"] == [] and [p["type"] for p in item["content"]] == ["reasoning_text"]
                blocks.append(("reasoning", item["content"][0]["text"]))
            elif item["type"] == "message":
                blocks.append(("text", "".join(p["text"] for p in item["content"])))
            else:
                assert item["type"] == "function_call" and item["call_id"] and item["status"] == "completed"
                blocks.append(("call", item["name"], json.loads(item["arguments"])))
        usage = body["usage"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        return Result(
            200,
            blocks,
            body["status"],
            prompt_tokens=usage["input_tokens"],
            output_tokens=usage["output_tokens"],
            reasoning_tokens=usage["output_tokens_details"]["reasoning_tokens"],
            body=body,
            events=events or [],
        )


API = {"messages": Messages, "responses": Responses}


@pytest.fixture(scope="module")
def app(qwen3_core: Path) -> Iterator[ScriptedServer]:
    with scripted_app(qwen3_core) as server:
        yield server


@pytest.fixture(params=sorted(API))
def api(request, app: ScriptedServer, schemas: Schemas) -> Messages | Responses:
    return API[request.param](app, schemas)


def both(api: Messages | Responses, script: str | tuple[str, ...], **body: Any) -> Result:
    """The buffered answer, after checking that the streamed answer is the same."""
    texts = (script,) if isinstance(script, str) else script
    api.app.say(*texts)
    buffered = api.buffered(body)
    api.app.say(*texts)
    streamed = api.streamed(body)
    if buffered.status != 200:
        assert streamed.error is not None, "a failed buffered request must end its stream with an error"
        assert streamed.error == buffered.error
    else:
        assert streamed.error is None and streamed.same_answer() == buffered.same_answer()
    buffered.streamed = streamed
    return buffered


def failed(api: Messages | Responses, result: Result, *words: str) -> None:
    """HTTP 500 buffered, a terminal error event streamed; server_error, or api_error on Messages."""
    kind = "api_error" if api.name == "messages" else "server_error"
    assert result.status == 500 and result.error_type == kind, result
    assert result.streamed is not None and result.streamed.error_type == kind
    for word in words:
        assert word in result.error


def tokens(app: ScriptedServer, text: str) -> int:
    return len(app.state.frontend.tokenizer.encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------------------- tool_choice auto
def test_auto_reasoning_then_tool_call(api) -> None:
    script = "<think>The user wants weather.</think>" + CALL
    result = both(api, script, tools=api.tools("get_weather"), **api.choice("auto"))
    assert result.blocks == [("reasoning", "The user wants weather."), ("call", *WEATHER_CALL)]
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    assert result.output_tokens == tokens(api.app, script) + 1  # reasoning and the call, plus EOS
    if api.name == "responses":
        assert result.body["tool_choice"] == "auto" and result.body["parallel_tool_calls"] is True
        assert 0 < result.reasoning_tokens < result.output_tokens
    assert "get_weather" in api.app.last_prompt()


def test_auto_returns_undeclared_tools_as_generated(api) -> None:
    result = both(api, call("undeclared", {"x": 1}), tools=api.tools("get_weather"))
    assert result.blocks == [("call", "undeclared", {"x": 1})]
    assert result.reasoning_tokens in (None, 0)  # no reasoning, none counted
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")


def test_auto_parallel_calls(api) -> None:
    result = both(api, "Both." + CALL + "\n" + TIME_CALL, tools=api.tools("get_weather", "get_time"))
    assert result.blocks == [("text", "Both."), ("call", *WEATHER_CALL), ("call", "get_time", {})]


def test_auto_truncated_call_reports_the_limit(api) -> None:
    limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
    result = both(api, CALL, tools=api.tools("get_weather"), **limit)
    assert result.calls == [] and result.output_tokens == 5
    assert result.stop == ("max_tokens" if api.name == "messages" else "incomplete")
    if api.name == "responses":
        assert result.body["incomplete_details"] == {"reason": "max_output_tokens"}


# ---------------------------------------------------------------------------- tool_choice none
def test_none_presents_no_tools_and_parses_no_calls(api) -> None:
    result = both(api, "<think>No tools.</think>" + CALL, tools=api.tools("get_weather"), **api.choice("none"))
    assert "get_weather" not in api.app.last_prompt() and "<tools>" not in api.app.last_prompt()
    assert result.calls == [] and result.reasoning == "No tools."
    assert "get_weather" in result.text  # the call syntax stays ordinary answer text
    assert result.stop == ("end_turn" if api.name == "messages" else "completed")


# ---------------------------------------------------------------------------- required
def test_required_without_a_call_fails(api) -> None:
    result = both(api, "No tools needed.", tools=api.tools("get_weather"), **api.choice("required"))
    failed(api, result, "requires a tool call")
    assert REQUIRED_TOOL_INSTRUCTION in api.app.last_prompt()


def test_required_with_a_truncated_call_fails(api) -> None:
    limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
    result = both(api, CALL, tools=api.tools("get_weather"), **api.choice("required"), **limit)
    failed(api, result, "requires a tool call")


def test_required_only_undeclared_calls_fails(api) -> None:
    result = both(api, call("undeclared", {}), tools=api.tools("get_weather"), **api.choice("required"))
    failed(api, result, "requires a tool call")


def test_required_with_a_call(api) -> None:
    result = both(api, "<think>Call it.</think>" + CALL, tools=api.tools("get_weather"), **api.choice("required"))
    assert result.blocks == [("reasoning", "Call it."), ("call", *WEATHER_CALL)]
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    assert REQUIRED_TOOL_INSTRUCTION in api.app.last_prompt()
    if api.name == "responses":
        assert result.body["tool_choice"] == "required"


def test_required_needs_a_declared_tool(api) -> None:
    response = api.post(api.choice("required"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- named
def test_named_presents_only_the_selected_tool_and_hides_answer_text(api) -> None:
    script = "<think>Weather tool.</think>Sure, calling it." + CALL
    result = both(api, script, tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_weather"))
    prompt = api.app.last_prompt()
    assert '"name": "get_weather"' in prompt and "get_time" not in prompt
    assert result.blocks == [("reasoning", "Weather tool."), ("call", *WEATHER_CALL)]  # no answer text
    assert result.output_tokens == tokens(api.app, script) + 1  # usage counts the omitted text
    assert result.stop == ("tool_use" if api.name == "messages" else "completed")
    if api.name == "messages":  # no text block was ever opened in the stream either
        starts = [d["content_block"]["type"] for n, d in result.streamed.events if n == "content_block_start"]
        assert starts == ["thinking", "tool_use"]
    else:
        added = [d["item"]["type"] for _, d in result.streamed.events if d["type"] == "response.output_item.added"]
        assert added == ["reasoning", "function_call"]
        assert result.body["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_named_call_to_another_tool_fails(api) -> None:
    result = both(api, CALL, tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_time"))
    failed(api, result, "get_time", "get_weather")


def test_named_without_a_call_fails(api) -> None:
    result = both(api, "Just text.", tools=api.tools("get_weather", "get_time"), **api.choice("named", "get_time"))
    failed(api, result, "requires a tool call")


def test_named_must_be_declared(api) -> None:
    response = api.post({"tools": api.tools("get_weather"), **api.choice("named", "get_time")})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- parallel calls off
def test_parallel_off_fails_on_the_second_call(api) -> None:
    body = {"tools": api.tools("get_weather", "get_time"), **api.choice("auto", parallel=False)}
    result = both(api, CALL + "\n" + TIME_CALL, **body)
    failed(api, result, "parallel_tool_calls")
    events = result.streamed.events  # the stream may already have delivered the first call, never the second
    if api.name == "messages":
        names = [
            d["content_block"]["name"]
            for n, d in events
            if n == "content_block_start" and d["content_block"]["type"] == "tool_use"
        ]
    else:
        names = [
            d["item"]["name"]
            for _, d in events
            if d["type"] == "response.output_item.added" and d["item"]["type"] == "function_call"
        ]
    assert "get_time" not in names


def test_parallel_off_with_one_call(api) -> None:
    result = both(api, CALL, tools=api.tools("get_weather"), **api.choice("required", parallel=False))
    assert result.blocks == [("call", *WEATHER_CALL)]
    if api.name == "responses":
        assert result.body["parallel_tool_calls"] is False


# ---------------------------------------------------------------------------- reasoning budgets
THINK_OPEN = "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
EFFORT_LINE = (
    "{%- if reasoning_effort is defined %}"
    "{{- '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}\n"
)
REASONING = "one two three four five six seven"


@contextmanager
def thinking_template(app: ScriptedServer) -> Iterator[None]:
    """A Qwen3-Thinking-style variant of the core's template: its generation prompt opens
    reasoning ("<think>\\n", so output starts inside reasoning and a budget can cut it) unless
    thinking is disabled, and it states the reasoning effort it is given."""
    frontend = app.state.frontend
    original = frontend.template
    source = original.source.replace(
        THINK_OPEN,
        THINK_OPEN.replace("    {%- endif %}", "    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}"),
    )
    assert source != original.source
    frontend.template = ChatTemplate(EFFORT_LINE + source, original.special_tokens)
    try:
        yield
    finally:
        frontend.template = original


def cuts(app: ScriptedServer) -> int:
    metrics = app.get("/metrics", params={"format": "json"}).json()
    assert metrics["reasoning_budget_cuts"] == app.state.client.engine.stats.reasoning_budget_cuts
    return metrics["reasoning_budget_cuts"]


def budget_fields(api, kind: str, budget: int) -> dict[str, Any]:
    if kind == "budget_tokens":
        return {"thinking": {"type": "enabled", "budget_tokens": budget}}
    if kind == "both":
        return {"thinking": {"type": "enabled", "budget_tokens": budget}, "thinking_token_budget": budget}
    return {"thinking_token_budget": budget}


BUDGET_CASES = [
    ("messages", "budget_tokens"),
    ("messages", "thinking_token_budget"),
    ("messages", "both"),
    ("responses", "thinking_token_budget"),
]


# The forced close takes the place of the scripted model's fourth token ("w"): 3 reasoning
# tokens ("on", "e", " t"), the close, then the answer.
CUT = ("one t", "w", "Final answer.")


@pytest.mark.parametrize(("protocol", "kind"), BUDGET_CASES)
def test_budget_forces_the_close_token(protocol: str, kind: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    assert tokens(app, CUT[0]) == 3
    with thinking_template(app):
        before = cuts(app)
        result = both(api, CUT, **budget_fields(api, kind, 3))
        assert app.last_prompt().endswith("<|im_start|>assistant\n<think>\n")
        assert cuts(app) == before + 2  # buffered and streamed
        assert result.blocks == [("reasoning", "one t"), ("text", "Final answer.")]
        assert result.stop == ("end_turn" if api.name == "messages" else "completed")
        # The forced close is a generated token (it replaced the fourth scripted token), and usage counts it.
        assert result.output_tokens == tokens(app, "".join(CUT)) + 1  # plus EOS
        if api.name == "responses":  # the reasoning region: its 3 tokens and the close delimiter
            assert 3 <= result.reasoning_tokens <= 4
        # The forced close counts within the output limit: 3 reasoning + close + 1 answer token.
        limit = {"max_tokens": 5} if api.name == "messages" else {"max_output_tokens": 5}
        limited = both(api, CUT, **budget_fields(api, kind, 3), **limit)
        assert cuts(app) == before + 4
        assert limited.blocks == [("reasoning", "one t"), ("text", "F")] and limited.output_tokens == 5
        assert limited.stop == ("max_tokens" if api.name == "messages" else "incomplete")


def test_budget_close_has_no_logprob_entry(app: ScriptedServer, schemas: Schemas) -> None:
    api = Responses(app, schemas)
    with thinking_template(app):
        app.say(*CUT)
        result = api.buffered(
            {"thinking_token_budget": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
        )
    entries = result.body["output"][-1]["content"][0]["logprobs"]
    assert [e["token"] for e in entries] == ["F", "in", "a", "l", " a", "n", "s", "w", "er", "."]
    assert "".join(e["token"] for e in entries) == result.text == "Final answer."


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_without_a_cut(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    script = "<think>" + REASONING + "</think>Answer."
    before = cuts(app)
    # The core's own template starts output in content: the budget is accepted without a cut.
    result = both(api, script, thinking_token_budget=3)
    assert result.reasoning == REASONING and result.text == "Answer." and cuts(app) == before
    with thinking_template(app):
        # A budget larger than the reasoning never cuts.
        result = both(api, REASONING + "</think>Answer.", thinking_token_budget=50)
        assert result.reasoning == REASONING and result.text == "Answer." and cuts(app) == before
        if api.name == "messages":
            # Disabled thinking closes reasoning in the prompt; Messages budgets above the 32-bit
            # limit are accepted and never cut.
            disabled = both(api, "Answer.", thinking={"type": "disabled"}, thinking_token_budget=3)
            assert app.last_prompt().endswith("<think>\n\n</think>\n\n") and disabled.text == "Answer."
            huge = both(api, REASONING + "</think>Answer.", thinking={"type": "enabled", "budget_tokens": 1 << 31})
            assert huge.reasoning == REASONING and huge.text == "Answer." and cuts(app) == before
            adaptive = both(api, REASONING + "</think>Answer.", thinking={"type": "adaptive", "budget_tokens": 10**12})
            assert adaptive.reasoning == REASONING and cuts(app) == before


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_after_a_tool_call_ended_reasoning(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    """Qwen's <tool_call> ends reasoning implicitly: the budget has nothing left to close."""
    api = API[protocol](app, schemas)
    assert tokens(app, "ab") == 2
    with thinking_template(app):
        before = cuts(app)
        result = both(api, ("ab", CALL), tools=api.tools("get_weather"), thinking_token_budget=3)
        assert result.blocks == [("reasoning", "ab"), ("call", *WEATHER_CALL)] and cuts(app) == before


@pytest.mark.parametrize("protocol", sorted(API))
def test_budget_rejections(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    bad = [{"thinking_token_budget": 0}, {"thinking_token_budget": 1 << 31}, {"thinking_token_budget": "8"}]
    if api.name == "messages":
        bad += [
            {"thinking": {"type": "enabled", "budget_tokens": 2048}, "thinking_token_budget": 1024},
            {"thinking": {"type": "enabled"}},
            {"thinking": {"type": "enabled", "budget_tokens": 0}},
        ]
    for fields in bad:
        response = api.post(fields)
        assert response.status_code == 400, fields
        body = response.json()
        if api.name == "messages":
            schemas.anthropic_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error" and "budget" in body["error"]["message"]
        else:
            schemas.openai_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["param"] is None and "thinking_token_budget" in body["error"]["message"]


# ---------------------------------------------------------------------------- effort
def rendered_effort(app: ScriptedServer) -> str | None:
    prompt = app.last_prompt()
    marker = "Reasoning effort: "
    return prompt.split(marker, 1)[1].split("<|im_end|>", 1)[0] if marker in prompt else None


EFFORT_CASES = [
    # (protocol, request fields, resolved level in the template's vocabulary: low / medium / high)
    ("responses", {"reasoning": {"effort": "low"}}, "low"),
    ("responses", {"reasoning": {"effort": "medium"}}, "medium"),
    ("responses", {"reasoning": {"effort": "high"}}, "high"),
    ("responses", {"reasoning": {"effort": "xhigh"}}, "high"),
    ("responses", {"reasoning": {"effort": "minimal"}}, "low"),
    ("responses", {}, None),
    ("messages", {"output_config": {"effort": "low"}}, "low"),
    ("messages", {"output_config": {"effort": "medium"}}, "medium"),
    ("messages", {"output_config": {"effort": "high"}}, "high"),
    ("messages", {"output_config": {"effort": "max"}}, "high"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 5000}}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 5001}}, "high"),
    ("messages", {"thinking": {"type": "adaptive", "budget_tokens": 20000}}, "high"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 20001}}, "high"),  # max, nearest in vocabulary
    ("messages", {"thinking_token_budget": 100}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 20000}, "output_config": {"effort": "low"}}, "low"),
    (
        "messages",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "medium"}},
        "medium",
    ),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1 << 40}}, "high"),
    ("messages", {}, None),
]


@pytest.mark.parametrize(("protocol", "fields", "level"), EFFORT_CASES)
def test_effort_reaches_the_template(
    protocol: str, fields: dict[str, Any], level: str | None, app: ScriptedServer, schemas: Schemas
) -> None:
    api = API[protocol](app, schemas)
    with thinking_template(app):
        result = both(api, "Thought.</think>Answer.", **fields)
        assert rendered_effort(app) == level and result.text == "Answer."
    if api.name == "responses":  # the response echoes the effort as sent
        assert result.body["reasoning"]["effort"] == fields.get("reasoning", {}).get("effort")


@pytest.mark.parametrize("protocol", sorted(API))
def test_numeric_effort_is_rejected(protocol: str, app: ScriptedServer, schemas: Schemas) -> None:
    api = API[protocol](app, schemas)
    param = "reasoning.effort" if api.name == "responses" else "output_config.effort"
    for value in (80, 80.0, "80", True, "extreme"):
        fields = {"reasoning": {"effort": value}} if api.name == "responses" else {"output_config": {"effort": value}}
        response = api.post(fields)
        assert response.status_code == 400, value
        body = response.json()
        if api.name == "messages":
            schemas.anthropic_body("ErrorResponse", body)
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert param in body["error"]["message"]
        else:
            schemas.openai_body("ErrorResponse", body)
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None
            assert param in body["error"]["message"]


def _chat_effort(app: ScriptedServer, **fields: Any) -> str | None:
    app.say("Thought.</think>Answer.")
    body = app.post(
        "/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": ASK}], "max_tokens": 64, **fields},
    ).json()
    assert body["choices"][0]["message"]["content"] == "Answer."
    return rendered_effort(app)


def test_chat_effort_is_the_template_option(app: ScriptedServer) -> None:
    """Chat's reasoning_effort is the native template option: it reaches a Jinja template as
    sent (chat_template_kwargs wins), unlike the named Responses and Messages settings."""
    with thinking_template(app):
        assert _chat_effort(app) is None
        assert _chat_effort(app, chat_template_kwargs={"reasoning_effort": "medium"}) == "medium"
        assert _chat_effort(app, reasoning_effort="low") == "low"
        assert _chat_effort(app, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == "high"


# ---------------------------------------------------------------------------- a core without reasoning syntax
@pytest.fixture(scope="module")
def plain(tiny_core: Path) -> Iterator[ScriptedServer]:
    with scripted_app(tiny_core) as server:
        yield server


def test_budgets_without_reasoning_syntax(plain: ScriptedServer, schemas: Schemas) -> None:
    """thinking.budget_tokens is an advisory hint where no hard cap is possible; an explicit
    thinking_token_budget is a 400 naming it, on every protocol."""
    messages = Messages(plain, schemas)
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive", "budget_tokens": 30000}):
        result = both(messages, "Hello there.", thinking=thinking)
        assert result.blocks == [("text", "Hello there.")] and result.stop == "end_turn"
    for api in (messages, Responses(plain, schemas)):
        response = api.post({"thinking_token_budget": 1024})
        assert response.status_code == 400 and "thinking_token_budget" in response.text, response.text
    both_fields = messages.post({"thinking": {"type": "enabled", "budget_tokens": 1024}, "thinking_token_budget": 1024})
    assert both_fields.status_code == 400 and "thinking_token_budget" in both_fields.text
