"""GLM 4.5-5.x calls: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>.

GLM 4.5/4.6 put newlines between the parts. <tool_call> starts a call only when a function
name and an <arg_key> or </tool_call> tag follow. String values are raw, others JSON (guided
by the tool schema); a missing </arg_value> is closed by the next <arg_key> or the call's end.
"""

from __future__ import annotations

from helios.frontend.parsers.envelope import CONFIRM, ToolCallError, ToolParser, put_argument
from helios.frontend.parsers.markup import FAIL, MORE, Marks, find_earliest, first_of, lit, name_end, skip_space
from helios.frontend.parsers.schema import ToolSchemas, convert

SPELLINGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


class Glm47Parser(ToolParser):
    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.opener, self.call_close = marks["<tool_call>"], marks["</tool_call>"]
        self.key_open, self.key_close = marks["<arg_key>"], marks["</arg_key>"]
        self.value_open, self.value_close = marks["<arg_value>"], marks["</arg_value>"]

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.opener,) if kind == "text" else ()

    def decide(self, buf: str, i: int, opener: str) -> int:
        start = skip_space(buf, i + len(opener))
        end = name_end(buf, start)
        if end == FAIL:
            return FAIL
        if end == len(buf):
            return MORE
        if end == start:
            return FAIL
        found = first_of(buf, skip_space(buf, end), (self.key_open, self.call_close))
        return CONFIRM if found >= 0 else found

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        decode = self.marks.decode
        first = body.find(self.key_open)
        name = decode(body[len(self.opener) : first if first >= 0 else len(body)]).strip()
        arguments: dict[str, object] = {}
        pos = len(self.opener)
        while (at := body.find(self.key_open, pos)) >= 0:
            key_end = body.find(self.key_close, at)
            if key_end < 0:
                raise ToolCallError("malformed <arg_key> tag")
            key = decode(body[at + len(self.key_open) : key_end]).strip()
            start = lit(body, skip_space(body, key_end + len(self.key_close)), self.value_open)
            if start < 0:
                raise ToolCallError(f"tool call argument {key!r} has no <arg_value>")
            boundary = find_earliest(body, (self.value_close, self.key_open), start)
            value_end = boundary[0] if boundary else len(body)
            value = decode(body[start:value_end])
            put_argument(arguments, key, convert(value, self.schemas.parameter(name, key)))
            pos = value_end + (len(self.value_close) if boundary and boundary[1] == self.value_close else 0)
        return name, arguments
