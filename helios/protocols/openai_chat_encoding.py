"""OpenAI Chat Completions encoding: the buffered chat.completion and the chunk stream.

Both encoders take the same choice updates. A stream sends a choice's role chunk only once
its first token exists, then a chunk per text/reasoning/tool-call event with the update's
logprob entries (and token observations) on the first of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helios.frontend.events import Accumulator, ReasoningEvent, TextEvent, ToolCallEvent
from helios.frontend.generate import ChoiceUpdate, Submission, Usage
from helios.frontend.inference import Termination
from helios.protocols.encoding import Buffered, data_frame, json_body
from helios.protocols.errors import openai_error
from helios.protocols.openai_chat import ChatOptions
from helios.protocols.openai_common import (
    ChunkStream,
    chat_logprob_entry,
    finish_reason,
    now,
    prompt_logprobs_wire,
    stream_chunk,
    usage_object,
)


@dataclass
class ChoiceState:
    """One choice of a buffered response."""

    blocks: Accumulator = field(default_factory=Accumulator)
    entries: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_timestamps: list[float] = field(default_factory=list)

    @property
    def finish(self) -> Termination | None:
        return self.blocks.finish.termination if self.blocks.finish else None

    def apply(self, update: ChoiceUpdate, options: ChatOptions) -> None:
        for event in update.events:
            self.blocks.push(event)
        self.token_ids += update.delta.token_ids
        self.token_timestamps += [update.observed] * len(update.delta.token_ids)
        if options.logprobs:
            self.entries += [chat_logprob_entry(e) for e in update.delta.entries]


def tool_call_json(call: ToolCallEvent, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return body if index is None else {"index": index, **body}


def _assistant_message(state: ChoiceState) -> dict[str, Any]:
    calls = state.blocks.tool_calls
    text = state.blocks.text
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if state.blocks.reasoning:
        message["reasoning_content"] = state.blocks.reasoning
    if calls:
        message["tool_calls"] = [tool_call_json(call) for call in calls]
    return message


def _observations(options: ChatOptions, token_ids: list[int], timestamps: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if options.return_token_ids:
        out["token_ids"] = token_ids
    if options.return_token_timestamps:
        out["token_timestamps"] = timestamps
    return out


def response(
    request_id: str,
    model: str,
    choices: dict[int, ChoiceState],
    usage: Usage,
    options: ChatOptions,
    prompt_logprobs: list | None,
    prompt_token_ids: tuple[int, ...] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": _assistant_message(state),
                "logprobs": {"content": state.entries, "refusal": None} if options.logprobs else None,
                "finish_reason": finish_reason(state.finish),
                **_observations(options, state.token_ids, state.token_timestamps),
            }
            for index, state in sorted(choices.items())
        ],
        "usage": usage_object(usage, reasoning=True),
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    if options.return_token_ids and prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    *,
    logprobs: list | None = None,
    finish: Termination | None = None,
    usage: dict | None = None,
    observations: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason(finish)}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs, "refusal": None}
    choice.update(observations or {})
    return stream_chunk("chat.completion.chunk", request_id, model, created, [choice], usage)


class ChatStream(ChunkStream):
    """The chunk stream; with continuous usage every chunk carries the cumulative counts."""

    kind = "chat.completion.chunk"
    reasoning = True
    options: ChatOptions

    def __init__(self, run: Submission, model: str, options: ChatOptions) -> None:
        super().__init__(run, model, options)
        self._started: set[int] = set()
        self._tool_calls: dict[int, int] = {}  # tool calls streamed so far, per choice

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        options = self.options
        usage = self.usage() if options.continuous_usage else None
        out = []
        if update.index not in self._started:  # the role delta only once the first token exists
            self._started.add(update.index)
            out.append(self._chunk(update.index, {"role": "assistant", "content": ""}, usage=usage))
        bodies = self._bodies(update)
        finish = update.finish.termination if update.finish is not None else None
        # Token observations without a usage chunk put the usage on the terminal chunk (spec).
        terminal = usage
        if finish is not None and usage is None and options.observes_tokens and not options.include_usage:
            terminal = self.usage()
        entries = [chat_logprob_entry(e) for e in update.delta.entries] if options.logprobs else None
        ids = list(update.delta.token_ids)
        observations = _observations(options, ids, [update.observed] * len(ids))
        for position, delta in enumerate(bodies):
            first, last = position == 0, position == len(bodies) - 1
            out.append(
                self._chunk(
                    update.index,
                    delta,
                    logprobs=entries if first else None,
                    finish=finish if last else None,
                    usage=terminal if last else usage,
                    observations=observations if first else None,
                )
            )
        return out

    def _bodies(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        """One delta per text, reasoning or tool-call event; an empty one when only entries,
        token ids or the finish need a chunk."""
        bodies: list[dict[str, Any]] = []
        for event in update.events:
            if isinstance(event, TextEvent) and event.text:
                bodies.append({"content": event.text})
            elif isinstance(event, ReasoningEvent) and event.text:
                bodies.append({"reasoning_content": event.text})
            elif isinstance(event, ToolCallEvent):
                position = self._tool_calls.get(update.index, 0)
                self._tool_calls[update.index] = position + 1
                bodies.append({"tool_calls": [tool_call_json(event, position)]})
        observed = (self.options.logprobs and update.delta.entries) or (
            self.options.observes_tokens and update.delta.token_ids
        )
        if not bodies and (observed or update.finish is not None):
            bodies.append({} if update.finish is not None else {"content": ""})
        return bodies

    def _chunk(self, index: int, delta: dict[str, Any], **fields: Any) -> bytes:
        return data_frame(chunk(self.run.request_id, self.model, self.run.created, index, delta, **fields))


class ChatBuffer(Buffered):
    """The buffered chat.completion, from the same updates."""

    error_body = staticmethod(openai_error)

    def __init__(self, run: Submission, model: str, options: ChatOptions, token_text: Callable[[int], str]) -> None:
        self.run, self.model, self.options, self.token_text = run, model, options, token_text
        self._choices: dict[int, ChoiceState] = {}

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        self._choices.setdefault(update.index, ChoiceState()).apply(update, self.options)
        return []

    def finish(self) -> list[bytes]:
        generation = self.run.generations[0]
        prompt_logprobs = prompt_logprobs_wire(generation.prompt_logprobs, self.token_text)
        return [
            json_body(
                response(
                    self.run.request_id,
                    self.model,
                    self._choices,
                    self.run.usage(),
                    self.options,
                    prompt_logprobs,
                    generation.prompt.token_ids,
                )
            )
        ]


def encoder(
    run: Submission, model: str, options: ChatOptions, token_text: Callable[[int], str]
) -> ChatStream | ChatBuffer:
    return ChatStream(run, model, options) if run.request.stream else ChatBuffer(run, model, options, token_text)
