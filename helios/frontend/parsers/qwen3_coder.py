"""Function-tag calls (Qwen3-Coder, Qwen3.5+, Nemotron, Step; MiMo's compact variant).

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

An opener starts a call only when a <function=NAME> header and a <parameter= or </function>
tag follow; otherwise it stays text. <tool_call> also ends reasoning; in answer text the outer
tags may be omitted. Calls complete at </function>; a missing </parameter> is closed by the
next parameter or the function's end. String values are raw, others follow the tool schema.
"""

from __future__ import annotations

from helios.frontend.parsers.envelope import CONFIRM, ToolCallError, ToolParser, put_argument
from helios.frontend.parsers.markup import FAIL, MORE, Marks, find_earliest, first_of, lit, name_end, skip_space
from helios.frontend.parsers.schema import ToolSchemas, convert

SPELLINGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


class Qwen3CoderParser(ToolParser):
    scans_reasoning = True
    trim_newlines = True  # one wrapping newline on each side of a value is markup, not value

    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        super().__init__(marks, schemas)
        self.tool_call, self.block_close = marks["<tool_call>"], marks["</tool_call>"]
        self.call_open, self.call_close = marks["<function="], marks["</function>"]
        self.param_open, self.param_close = marks["<parameter="], marks["</parameter>"]

    def openers(self, kind: str) -> tuple[str, ...]:
        return (self.tool_call, self.call_open) if kind == "text" else (self.tool_call,)

    def opens_block(self, opener: str) -> bool:
        return opener == self.tool_call

    def decide(self, buf: str, i: int, opener: str) -> int:
        at = i + len(opener)
        if opener == self.tool_call:
            at = lit(buf, skip_space(buf, at), self.call_open)
            if at < 0:
                return at
        end = name_end(buf, at)
        if end == FAIL:
            return FAIL
        if end == len(buf):
            return MORE
        if end == at or buf[end] != ">":
            return FAIL
        found = first_of(buf, skip_space(buf, end + 1), (self.param_open, self.call_close))
        return CONFIRM if found >= 0 else found

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        decode = self.marks.decode
        header_end = body.find(">", len(self.call_open))
        if header_end < 0:
            raise ToolCallError("malformed <function=...> header")
        name = decode(body[len(self.call_open) : header_end]).strip()
        arguments: dict[str, object] = {}
        pos = header_end + 1
        while (at := body.find(self.param_open, pos)) >= 0:
            key_end = body.find(">", at + len(self.param_open))
            if key_end < 0:
                raise ToolCallError("malformed <parameter=...> tag")
            key = decode(body[at + len(self.param_open) : key_end]).strip()
            boundary = find_earliest(body, (self.param_close, self.param_open), key_end + 1)
            value_end = boundary[0] if boundary else len(body)
            value = decode(body[key_end + 1 : value_end])
            if self.trim_newlines:
                value = value[value.startswith("\n") :]
                value = value[: len(value) - value.endswith("\n")]
            put_argument(arguments, key, convert(value, self.schemas.parameter(name, key)))
            pos = value_end + (len(self.param_close) if boundary and boundary[1] == self.param_close else 0)
        return name, arguments


class MimoParser(Qwen3CoderParser):
    """MiMo's compact tags: values verbatim, indentation and newlines included."""

    trim_newlines = False
