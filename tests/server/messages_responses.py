"""The harness of the Messages/Responses suites: each case runs buffered and streamed on a
scripted model (tests/server/scripted.py); the stream is reassembled and must equal the buffered
result, and every body and event is parsed by the official SDK in strict mode and validated
against the published schema (the hosted Anthropic spec predates thinking blocks, so it checks
the envelope and the block types it knows)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from scripted import ScriptedServer, scripted_app
from serving import SCHEMA_PATH, schema_validator, sse_events
from support import ANTHROPIC_SPEC, anthropic_spec

from helios.protocols.anthropic_messages import thinking_signature

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


class Driver(ABC):
    """What the Messages and Responses drivers share: a buffered answer (or HTTP error) checked and
    read into a Result, and the named events of a stream."""

    def __init__(self, app: ScriptedServer, schemas: Schemas) -> None:
        self.app, self.schemas = app, schemas

    @abstractmethod
    def post(self, body: dict[str, Any]) -> httpx.Response: ...

    @abstractmethod
    def check_error(self, error: dict[str, Any]) -> None:
        """An HTTP error body is the protocol's error object."""

    @abstractmethod
    def check_answer(self, answer: dict[str, Any]) -> None:
        """A buffered answer (message or response object) is valid."""

    @staticmethod
    @abstractmethod
    def _result(answer: dict[str, Any], events: list | None = None) -> Result: ...

    def buffered(self, body: dict[str, Any]) -> Result:
        response = self.post(body)
        if response.status_code != 200:
            error = response.json()
            self.check_error(error)
            return Result(
                response.status_code, error=error["error"]["message"], error_type=error["error"]["type"], body=error
            )
        answer = response.json()
        self.check_answer(answer)
        assert response.headers["x-request-id"] == answer["id"]
        return self._result(answer)

    def stream(self, body: dict[str, Any]) -> tuple[httpx.Response, list[tuple[str, dict[str, Any]]]]:
        """The streamed response to `body` and its (event name, data)."""
        response = self.post({**body, "stream": True})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return response, _named_events(response)


class Messages(Driver):
    """POST /v1/messages with Anthropic tool and thinking fields."""

    name = "messages"

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

    def check_error(self, error: dict[str, Any]) -> None:
        self.schemas.anthropic_body("ErrorResponse", error)
        assert error["type"] == "error"

    def check_answer(self, answer: dict[str, Any]) -> None:
        self.schemas.check_message(answer)

    def streamed(self, body: dict[str, Any]) -> Result:
        _, events = self.stream(body)
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


class Responses(Driver):
    """POST /v1/responses with OpenAI Responses tool and reasoning fields."""

    name = "responses"

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

    def check_error(self, error: dict[str, Any]) -> None:
        self.schemas.openai_body("ErrorResponse", error)

    def check_answer(self, answer: dict[str, Any]) -> None:
        self.schemas.check_response(answer)

    def streamed(self, body: dict[str, Any]) -> Result:
        response, named = self.stream(body)
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
