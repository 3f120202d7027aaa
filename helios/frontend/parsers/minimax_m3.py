"""MiniMax M3 calls, every tag behind the namespace prefix NS = ]<]minimax[>[:

    NS<tool_call>\\nNS<invoke name="NAME">NS<KEY>VALUE NS</KEY>...NS</invoke>\\nNS</tool_call>

The prefixed opener always starts a block of calls; each completes at its </invoke>. Nested
values are XML elements (<item> for array members); scalars follow the tool schema.
"""

from __future__ import annotations

import re
from typing import Union

from helios.frontend.parsers.envelope import ToolCallError, ToolParser, put_argument
from helios.frontend.parsers.markup import Marks, skip_space
from helios.frontend.parsers.schema import Schema, ToolSchemas, convert, member, types_of

NAMESPACE = "]<]minimax[>["
SPELLINGS = (NAMESPACE, "<tool_call>", "</tool_call>")
_MAX_DEPTH = 64
_NAME = re.compile(r'\s*name\s*=\s*"(.*)"\s*', re.S)

Node = Union[str, list[tuple[str, "Node"]]]  # scalar text, or child elements in order


class MiniMaxM3Parser(ToolParser):
    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.ns = marks[NAMESPACE]
        self.opener, self.block_close = self.ns + marks["<tool_call>"], self.ns + marks["</tool_call>"]
        self.call_open, self.call_close = self.ns + "<invoke", self.ns + "</invoke>"

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.opener,) if kind == "text" else ()

    def opens_block(self, opener: str) -> bool:
        return True

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        header_end = body.find(">", len(self.call_open))
        match = _NAME.fullmatch(self.marks.decode(body[len(self.call_open) : max(header_end, 0)]))
        if header_end < 0 or match is None:
            raise ToolCallError('malformed <invoke name="..."> header')
        name, root = match.group(1), self.schemas.root(match.group(1))
        arguments: dict[str, object] = {}
        pos = skip_space(body, header_end + 1)
        while pos < len(body):
            key, node, pos = self._element(body, pos, 0)
            put_argument(arguments, key, self._value(node, self.schemas.parameter(name, key), root))
            pos = skip_space(body, pos)
        return name, arguments

    def _element(self, body: str, pos: int, depth: int) -> tuple[str, Node, int]:
        """One NS<TAG>...NS</TAG> element at pos: (tag, content, offset after it)."""
        opening = self.ns + "<"
        if depth > _MAX_DEPTH or not body.startswith(opening, pos) or body.startswith(self.ns + "</", pos):
            raise ToolCallError("malformed MiniMax tool call argument")
        tag_end = body.find(">", pos + len(opening))
        if tag_end < 0:
            raise ToolCallError("malformed MiniMax tool call argument")
        raw_tag = body[pos + len(opening) : tag_end]
        closing = f"{self.ns}</{raw_tag}>"
        inner = skip_space(body, tag_end + 1)
        if not body.startswith(opening, inner) or body.startswith(self.ns + "</", inner):
            end = body.find(closing, tag_end + 1)
            if end < 0:
                raise ToolCallError(f"unclosed <{self.marks.decode(raw_tag)}> in a MiniMax tool call")
            return self.marks.decode(raw_tag).strip(), self.marks.decode(body[tag_end + 1 : end]), end + len(closing)
        children: list[tuple[str, Node]] = []
        while not body.startswith(closing, inner):
            if inner >= len(body):
                raise ToolCallError(f"unclosed <{self.marks.decode(raw_tag)}> in a MiniMax tool call")
            tag, node, inner = self._element(body, inner, depth + 1)
            children.append((tag, node))
            inner = skip_space(body, inner)
        return self.marks.decode(raw_tag).strip(), children, inner + len(closing)

    def _value(self, node: Node, schema: Schema | None, root: Schema | None) -> object:
        types = [t for t in types_of(schema) if t in ("object", "array", "string")]
        if isinstance(node, str):
            if not node.strip() and types and types[0] != "string":
                return {} if types[0] == "object" else []  # an empty container renders as nothing
            return convert(node, schema)
        as_list = types[0] == "array" if types else all(tag == "item" for tag, _ in node)
        if as_list:
            return [self._value(child, member(schema, root, None), root) for _, child in node]
        members: dict[str, object] = {}
        for tag, child in node:
            put_argument(members, tag, self._value(child, member(schema, root, tag), root))
        return members
