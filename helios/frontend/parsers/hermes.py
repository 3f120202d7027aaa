"""Hermes / Qwen3 JSON calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

The opener always starts a call, in reasoning too, where it ends reasoning (Qwen3).
"""

from __future__ import annotations

import json

from helios.frontend.parsers.envelope import ToolCallError, ToolParser
from helios.frontend.parsers.markup import Marks
from helios.frontend.parsers.schema import ToolSchemas

SPELLINGS = ("<tool_call>", "</tool_call>")


class HermesParser(ToolParser):
    scans_reasoning = True

    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.opener, self.call_close = marks["<tool_call>"], marks["</tool_call>"]

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.opener,)

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        try:
            data = json.loads(self.marks.decode(body[len(self.opener) :]))
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ToolCallError("tool call needs a nonempty name")
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallError("tool call arguments are not a JSON object") from None
        return data["name"], arguments
