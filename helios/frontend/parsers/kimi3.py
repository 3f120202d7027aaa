"""Kimi K3 calls, tags written <|open|>TAG attrs<|sep|>...<|close|>TAG<|sep|>:

    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>...
    <|close|>call<|sep|><|close|>tools<|sep|>

A call may instead carry <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>. The tools
tag always starts a block; each call completes at its close. Argument types are explicit.
"""

from __future__ import annotations

import json
import re

from helios.frontend.parsers.envelope import ToolCallError, ToolParser, put_argument
from helios.frontend.parsers.markup import Marks, skip_space
from helios.frontend.parsers.schema import Schema, ToolSchemas, convert

SPELLINGS = ("<|open|>", "<|close|>", "<|sep|>")
_ATTRIBUTE = re.compile(r'([\w-]+)="([^"]*)"')


class Kimi3Parser(ToolParser):
    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.open, self.close, self.sep = marks["<|open|>"], marks["<|close|>"], marks["<|sep|>"]
        self.opener, self.block_close = f"{self.open}tools{self.sep}", f"{self.close}tools{self.sep}"
        self.call_open, self.call_close = f"{self.open}call", f"{self.close}call{self.sep}"

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.opener,) if kind == "text" else ()

    def opens_block(self, opener: str) -> bool:
        return True

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        attributes, pos = self._head(body, len(self.call_open))
        name = attributes.get("tool", "")
        arguments: dict[str, object] = {}
        while (pos := skip_space(body, pos)) < len(body):
            for tag in ("argument", "json"):
                if body.startswith(f"{self.open}{tag}", pos):
                    break
            else:
                raise ToolCallError("malformed Kimi tool call argument")
            attributes, start = self._head(body, pos + len(self.open) + len(tag))
            closing = f"{self.close}{tag}{self.sep}"
            end = body.find(closing, start)
            if end < 0:
                raise ToolCallError(f"unclosed {tag} in a Kimi tool call")
            text, pos = self.marks.decode(body[start:end]), end + len(closing)
            if tag == "argument":
                key = attributes.get("key", "")
                put_argument(arguments, key, _typed(text, attributes.get("type"), self.schemas.parameter(name, key)))
                continue
            try:
                block = json.loads(text)
            except ValueError:
                raise ToolCallError("Kimi tool call json block is not JSON") from None
            if not isinstance(block, dict):
                raise ToolCallError("tool call arguments must be a JSON object")
            for key, value in block.items():
                put_argument(arguments, key, value)
        return name, arguments

    def _head(self, body: str, pos: int) -> tuple[dict[str, str], int]:
        """Attributes of the tag whose name ends at pos, and the offset after its <|sep|>."""
        end = body.find(self.sep, pos)
        if end < 0:
            raise ToolCallError("malformed Kimi tool call tag")
        text = self.marks.decode(body[pos:end])
        attributes = {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTRIBUTE.findall(text)}
        return attributes, end + len(self.sep)


def _typed(text: str, declared: str | None, schema: Schema | None) -> object:
    """A value by its written type; without one, by the tool schema."""
    if declared == "string":
        return text
    if declared in ("number", "boolean", "null", "object", "array"):
        try:
            return json.loads(text)
        except ValueError:
            return text  # non-strict: the written text survives
    return convert(text, schema)
