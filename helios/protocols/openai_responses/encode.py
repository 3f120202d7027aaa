"""Responses output: output items, the response object, and the SSE event sequence.

Buffered responses and streams map the same accumulated blocks to the same items: ids are
derived from the response id and the item's position, so both agree.
"""

from __future__ import annotations

import json
from typing import Any

from helios.frontend.events import Accumulator, FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.generate import ChoiceUpdate, Submission, Usage
from helios.frontend.inference import Termination
from helios.protocols.encoding import KEEPALIVE_COMMENT, BufferedEvents, OutputValidationError, json_body
from helios.protocols.errors import openai_error
from helios.protocols.openai_common import chat_logprob_entry, now
from helios.protocols.openai_responses.decode import ResponsesOptions


# ---------------------------------------------------------------------------- items
def _item_id(prefix: str, response_id: str, index: int) -> str:
    return f"{prefix}_{response_id.removeprefix('resp_')}_{index}"


def _restored(name: str, options: ResponsesOptions) -> dict[str, Any]:
    if name in options.namespaces:
        space, inner = options.namespaces[name]
        return {"name": inner, "namespace": space}
    return {"name": name}


def custom_call(event: ToolCallEvent, options: ResponsesOptions) -> dict[str, Any]:
    """The custom_tool_call for a call the model made as {"input": string}; the grammar must match."""
    restored = _restored(event.name, options)
    try:
        arguments = json.loads(event.arguments)
    except json.JSONDecodeError:
        arguments = None
    value = arguments.get("input") if isinstance(arguments, dict) else None
    if not isinstance(value, str):
        raise OutputValidationError(f"custom tool {restored['name']!r} was called without a string input")
    grammar = options.custom_tools.get(event.name)
    if grammar is not None and not grammar.matches(value):
        raise OutputValidationError(
            f"custom tool {restored['name']!r} input does not match its {grammar.syntax} grammar"
        )
    return {"type": "custom_tool_call", "call_id": event.call_id, **restored, "input": value}


def call_item(event: ToolCallEvent, options: ResponsesOptions, item_id: str) -> dict[str, Any]:
    """A function_call or custom_tool_call item; undeclared names pass through as functions."""
    if event.name in options.custom_tools:
        return {"id": item_id, **custom_call(event, options)}
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": event.call_id,
        **_restored(event.name, options),
        "arguments": event.arguments,
        "status": "completed",
    }


def _call_prefix(item: dict[str, Any]) -> str:
    return "ctc" if item["type"] == "custom_tool_call" else "fc"


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning(item_id: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content}


def output_items(
    response_id: str, acc: Accumulator, options: ResponsesOptions, *, lenient: bool = False, incomplete: bool = False
) -> list[dict[str, Any]]:
    """The accumulated blocks as output items; `lenient` drops calls that fail validation."""
    items: list[dict[str, Any]] = []
    for block in acc.blocks:
        index = len(items)
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}]
            items.append(_reasoning(_item_id("rs", response_id, index), content))
        elif block.kind == "text":
            logprobs = [chat_logprob_entry(e) for e in block.entries] if options.logprobs else []
            items.append(_message(_item_id("msg", response_id, index), [_text_part(block.text, logprobs)], "completed"))
        elif block.call is not None:
            try:
                item = call_item(block.call, options, "")
            except OutputValidationError:
                if lenient:
                    continue
                raise
            items.append({**item, "id": _item_id(_call_prefix(item), response_id, index)})
    if incomplete and items and items[-1]["type"] == "message":
        items[-1]["status"] = "incomplete"  # the answer was cut by the output limit
    return items


# ---------------------------------------------------------------------------- response object
def status_of(finish: FinishEvent | None) -> str:
    """completed | incomplete (output limit) | failed (generation or tool-policy error)."""
    if finish is not None and finish.termination is Termination.LENGTH:
        return "incomplete"
    return "failed" if finish is not None and finish.termination is Termination.ERROR else "completed"


def usage_json(usage: Usage) -> dict[str, Any]:
    body = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }
    if usage.image_tokens:  # image requests: Chat's multimodal_tokens, beside the other input details
        body["input_tokens_details"]["multimodal_tokens"] = {"image": usage.image_tokens}
    return body


def _response(
    response_id: str,
    created_at: int,
    options: ResponsesOptions,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    error: str | None,
    model: str,
) -> dict[str, Any]:
    """The response object; `model` is the loaded model's public id, whatever the request named."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": now() if status == "completed" else None,
        "error": {"code": "server_error", "message": error or "generation failed"} if status == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": options.instructions,
        "model": model,
        "output": output,
        "parallel_tool_calls": options.parallel_tool_calls,
        "metadata": options.metadata,
        "tool_choice": options.tool_choice_echo,
        "tools": options.tools_echo,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_logprobs": options.top_logprobs,
        "max_output_tokens": options.max_output_tokens,
        "previous_response_id": None,
        "background": False,
        "store": False,
        "truncation": "disabled",
        "reasoning": {"effort": options.reasoning_effort, "summary": None},
        "text": {"format": options.text_format},
    }
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body


def response_json(
    response_id: str,
    created_at: int,
    acc: Accumulator,
    usage: Usage,
    options: ResponsesOptions,
    status: str,
    error: str | None = None,
    *,
    model: str,
) -> dict[str, Any]:
    """The buffered response object (also the payload of a stream's terminal event)."""
    output = output_items(response_id, acc, options, lenient=status == "failed", incomplete=status == "incomplete")
    return _response(response_id, created_at, options, status, output, usage, error, model)


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# ---------------------------------------------------------------------------- streaming
class ResponsesStream:
    """The SSE events of one response; items match `response_json` of the same blocks.

    Like the Accumulator, consecutive text (or reasoning) events extend one open item.
    """

    def __init__(self, response_id: str, created_at: int, options: ResponsesOptions, *, model: str) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.options = options
        self.model = model
        self.items: list[dict[str, Any]] = []  # closed items, in their final shapes
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the open text/reasoning item: kind, id, text, logprobs

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        body = _response(self.response_id, self.created_at, self.options, "in_progress", [], None, None, self.model)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def push(self, events: list[SemanticEvent]) -> list[dict[str, Any]]:
        """Events for a batch; a call failing validation raises before anything is emitted."""
        calls = {i: call_item(e, self.options, "") for i, e in enumerate(events) if isinstance(e, ToolCallEvent)}
        out: list[dict[str, Any]] = []
        for position, event in enumerate(events):
            if isinstance(event, (TextEvent, ReasoningEvent)) and (event.text or event.entries):
                out += self._delta("text" if isinstance(event, TextEvent) else "reasoning", event)
            elif isinstance(event, ToolCallEvent):
                out += self._close() + self._call(calls[position])
        return out

    def _delta(self, kind: str, event: TextEvent | ReasoningEvent) -> list[dict[str, Any]]:
        out = [] if self._open is not None and self._open["kind"] == kind else self._close() + self._begin(kind)
        state = self._open
        assert state is not None
        where = {"item_id": state["id"], "output_index": len(self.items), "content_index": 0}
        state["text"] += event.text
        if kind == "text":
            logprobs = [chat_logprob_entry(e) for e in event.entries] if self.options.logprobs else []
            state["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **where, delta=event.text, logprobs=logprobs))
        elif event.text:
            out.append(self._event("response.reasoning_text.delta", **where, delta=event.text))
        return out

    def _begin(self, kind: str) -> list[dict[str, Any]]:
        index = len(self.items)
        item_id = _item_id("msg" if kind == "text" else "rs", self.response_id, index)
        self._open = {"kind": kind, "id": item_id, "text": "", "logprobs": []}
        item = _message(item_id, [], "in_progress") if kind == "text" else _reasoning(item_id, [])
        part = _text_part("", []) if kind == "text" else {"type": "reasoning_text", "text": ""}
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part),
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        state, self._open = self._open, None
        if state is None:
            return []
        where = {"item_id": state["id"], "output_index": len(self.items), "content_index": 0}
        if state["kind"] == "text":
            part = _text_part(state["text"], state["logprobs"])
            item = _message(state["id"], [part], status)
            done = self._event("response.output_text.done", **where, text=state["text"], logprobs=state["logprobs"])
        else:
            part = {"type": "reasoning_text", "text": state["text"]}
            item = _reasoning(state["id"], [part])
            done = self._event("response.reasoning_text.done", **where, text=state["text"])
        self.items.append(item)
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.items)
        item = {**item, "id": _item_id(_call_prefix(item), self.response_id, index)}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "custom_tool_call":
            return [
                self._event("response.output_item.added", output_index=index, item={**item, "input": ""}),
                self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                self._event("response.custom_tool_call_input.done", **where, input=item["input"]),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, finish: FinishEvent, acc: Accumulator, usage: Usage) -> list[dict[str, Any]]:
        """Close the open item; end with response.completed / .incomplete / .failed (full object)."""
        status = status_of(finish)
        out = self._close("incomplete" if status == "incomplete" else "completed")
        body = response_json(
            self.response_id, self.created_at, acc, usage, self.options, status, finish.error, model=self.model
        )
        return out + [self._event(f"response.{status}", response=body)]

    def error(self, message: str, usage: Usage | None = None) -> list[dict[str, Any]]:
        """A terminal response.failed carrying the items emitted so far."""
        out = self._close("incomplete")
        body = _response(
            self.response_id, self.created_at, self.options, "failed", list(self.items), usage, message, self.model
        )
        return out + [self._event("response.failed", response=body)]


# ---------------------------------------------------------------------------- driver encoders
class ResponsesEncoder:
    """Named SSE events: the response is announced at once, items follow the updates."""

    def __init__(self, run: Submission, model: str, options: ResponsesOptions) -> None:
        self.run = run
        self.events = ResponsesStream(run.request_id, run.created, options, model=model)
        self._blocks = Accumulator()
        self._finish: FinishEvent | None = None

    def start(self) -> list[bytes]:
        return [sse(e) for e in self.events.start()]

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE_COMMENT]

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        events = list(update.events)
        for event in events:
            self._blocks.push(event)
        self._finish = update.finish or self._finish
        return [sse(e) for e in self.events.push(events)]  # a call failing validation raises first

    def finish(self) -> list[bytes]:
        finish = self._finish or FinishEvent(Termination.EOS)
        return [sse(e) for e in self.events.finish(finish, self._blocks, self.run.usage())]

    def error(self, status: int, message: str) -> list[bytes]:
        return [sse(e) for e in self.events.error(message, self.run.usage())]


class ResponsesBuffer(BufferedEvents):
    """The buffered response object; output failing its contract is a 500."""

    error_body = staticmethod(openai_error)

    def __init__(self, run: Submission, model: str, options: ResponsesOptions) -> None:
        super().__init__()
        self.run, self.model, self.options = run, model, options

    def finish(self) -> list[bytes]:
        status = status_of(self._blocks.finish)
        return [
            json_body(
                response_json(
                    self.run.request_id,
                    self.run.created,
                    self._blocks,
                    self.run.usage(),
                    self.options,
                    status,
                    model=self.model,
                )
            )
        ]


def encoder(run: Submission, model: str, options: ResponsesOptions) -> ResponsesEncoder | ResponsesBuffer:
    return ResponsesEncoder(run, model, options) if run.request.stream else ResponsesBuffer(run, model, options)
