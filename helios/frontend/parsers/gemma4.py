"""Gemma 4 calls: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:2,list:[1,2]}<tool_call|>.

The opener always starts a call. Keys are bare; strings sit between <|"|> quote tokens;
numbers, booleans and null are bare JSON scalars; objects and arrays nest.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from helios.frontend.parsers.envelope import ToolCallError, ToolParser, put_argument
from helios.frontend.parsers.markup import Marks, skip_space
from helios.frontend.parsers.schema import ToolSchemas

SPELLINGS = ("<|tool_call>", "<tool_call|>", '<|"|>')
_MAX_DEPTH = 64


class Gemma4Parser(ToolParser):
    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.opener, self.call_close, self.quote = marks["<|tool_call>"], marks["<tool_call|>"], marks['<|"|>']

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.opener,) if kind == "text" else ()

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        start = skip_space(body, len(self.opener))
        if not body.startswith("call:", start):
            raise ToolCallError("Gemma tool call does not start with call:NAME")
        brace = body.find("{", start)
        if brace < 0:
            raise ToolCallError("Gemma tool call has no argument object")
        reader = _Reader(body, brace, self.quote, self.marks.decode)
        arguments = reader.value(0)
        if body[skip_space(body, reader.at) :]:
            raise ToolCallError("unexpected text after a Gemma tool call's arguments")
        return self.marks.decode(body[start + len("call:") : brace]), arguments  # type: ignore[return-value]


class _Reader:
    """Recursive descent over Gemma's argument notation."""

    def __init__(self, text: str, at: int, quote: str, decode: Callable[[str], str]) -> None:
        self.text, self.at, self.quote, self.decode = text, at, quote, decode

    def value(self, depth: int) -> object:
        if depth > _MAX_DEPTH:
            raise ToolCallError("Gemma tool call arguments nest too deeply")
        self.at = skip_space(self.text, self.at)
        if self.text.startswith(self.quote, self.at):
            end = self.text.find(self.quote, self.at + len(self.quote))
            if end < 0:
                raise ToolCallError("unterminated string in a Gemma tool call")
            value = self.decode(self.text[self.at + len(self.quote) : end])
            self.at = end + len(self.quote)
            return value
        if self.text.startswith("{", self.at):
            return self._members(depth)
        if self.text.startswith("[", self.at):
            return self._items(depth)
        end = self.at
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        raw, self.at = self.decode(self.text[self.at : end]).strip(), end
        try:
            return json.loads(raw)
        except ValueError:
            return raw  # a bare word the model did not quote stays text

    def _members(self, depth: int) -> dict[str, object]:
        members: dict[str, object] = {}
        self.at += 1
        if self._close("}"):
            return members
        while True:
            self.at = skip_space(self.text, self.at)
            if self.text.startswith(self.quote, self.at):
                key = str(self.value(depth + 1))
                self.at = skip_space(self.text, self.at)
            else:
                end = self.at
                while (
                    end < len(self.text)
                    and self.text[end] not in ":,{}[]"
                    and not self.text.startswith(self.quote, end)
                ):
                    end += 1
                key, self.at = self.decode(self.text[self.at : end]).strip(), end
            if not self.text.startswith(":", self.at):
                raise ToolCallError("malformed member in a Gemma tool call")
            self.at += 1
            put_argument(members, key, self.value(depth + 1))
            if not self._separator("}"):
                return members

    def _items(self, depth: int) -> list[object]:
        items: list[object] = []
        self.at += 1
        if self._close("]"):
            return items
        while True:
            items.append(self.value(depth + 1))
            if not self._separator("]"):
                return items

    def _close(self, bracket: str) -> bool:
        self.at = skip_space(self.text, self.at)
        if self.text.startswith(bracket, self.at):
            self.at += 1
            return True
        return False

    def _separator(self, bracket: str) -> bool:
        """True after a comma (more follow); False after the closing bracket."""
        self.at = skip_space(self.text, self.at)
        if self.text.startswith(",", self.at):
            self.at += 1
            return True
        if self._close(bracket):
            return False
        raise ToolCallError("malformed Gemma tool call arguments")
