"""Tool-call syntaxes. `hermes`: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
with single-token tags (Qwen3, Hermes); the JSON body is buffered until the close tag."""

from __future__ import annotations

import itertools
import json

from tokenizers import Tokenizer

from helios.frontend.events import SemanticEvent, TextEvent, ToolCallEvent

MAX_ARGUMENT_BYTES = 8 << 20
_call_ids = itertools.count()


class ToolCallError(ValueError):
    """The model wrote a malformed or incomplete tool call."""


def new_call_id() -> str:
    return f"call_{next(_call_ids):012x}"


class ToolParser:
    def __init__(self, open_id: int, close_id: int) -> None:
        self.opener_ids = frozenset({open_id})
        self.open_id, self.close_id = open_id, close_id
        self.buffer: list[str] | None = None  # inside an envelope

    def feed(self, event: TextEvent, token_id: int) -> list[SemanticEvent]:
        if token_id == self.open_id and self.buffer is None:
            self.buffer = []
            return []
        if self.buffer is not None:
            if token_id == self.close_id:
                body, self.buffer = "".join(self.buffer), None
                return [self._call(body)]
            self.buffer.append(event.text)
            if sum(len(t) for t in self.buffer) > MAX_ARGUMENT_BYTES:
                raise ToolCallError("tool call arguments exceed 8 MiB")
            return []
        return [event]

    def finish(self, truncated: bool) -> list[SemanticEvent]:
        if self.buffer is not None and not truncated:
            raise ToolCallError("the model ended inside an unfinished tool call")
        self.buffer = None  # a truncated envelope is omitted; the response reports the length limit
        return []

    @staticmethod
    def _call(body: str) -> ToolCallEvent:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise ToolCallError("tool call needs a nonempty name")
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallError("tool call arguments are not a JSON object") from None
        if not isinstance(arguments, dict):
            raise ToolCallError("tool call arguments must be a JSON object")
        return ToolCallEvent(new_call_id(), data["name"], json.dumps(arguments, ensure_ascii=False))


def tool_parser(syntax: str, tokenizer: Tokenizer) -> ToolParser | None:
    if syntax == "hermes":
        ids = tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")
        if None in ids:
            return None
        return ToolParser(*ids)  # type: ignore[arg-type]
    return None
