"""Output parsers: split a choice's tokens into answer text, reasoning and tool calls.

A parser consumes Pieces (one per settled token) and emits semantic events. Reasoning
and tool syntaxes are named by the core's recipe; `build_parser` assembles the parser a
request needs. Delimiters that are single tokens act only when generated as that token.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from helios.frontend.events import SemanticEvent, TextEvent
from helios.frontend.output import Piece
from helios.frontend.parsers.reasoning import ReasoningSplitter, reasoning_delimiters
from helios.frontend.parsers.tools import ToolParser, tool_parser


class UnsupportedSyntax(ValueError):
    """The core names a syntax this helios has no parser for."""


@dataclass
class OutputParser:
    reasoning: ReasoningSplitter | None
    tools: ToolParser | None

    def feed(self, piece: Piece) -> list[SemanticEvent]:
        events: list[SemanticEvent] = []
        for event in self.reasoning.feed(piece) if self.reasoning else [TextEvent(piece.text, _entries(piece))]:
            if isinstance(event, TextEvent) and self.tools is not None:
                events += self.tools.feed(event, piece.token_id)
            else:
                events.append(event)
        return events

    def finish(self, truncated: bool) -> list[SemanticEvent]:
        return self.tools.finish(truncated) if self.tools else []


def _entries(piece: Piece) -> tuple:
    return (piece.entry,) if piece.entry is not None else ()


def build_parser(tokenizer: Tokenizer, reasoning_syntax: str | None, tool_syntax: str | None,
                 prompt_ids: tuple[int, ...], tools_enabled: bool) -> OutputParser:  # fmt: skip
    reasoning = None
    if reasoning_syntax is not None:
        delimiters = reasoning_delimiters(reasoning_syntax, tokenizer)
        if delimiters is None:
            raise UnsupportedSyntax(f"no parser for reasoning syntax {reasoning_syntax!r}")
        reasoning = ReasoningSplitter(*delimiters, prompt_ids=prompt_ids)
    tools = None
    if tool_syntax is not None and tools_enabled:
        tools = tool_parser(tool_syntax, tokenizer)
        if tools is None:
            raise UnsupportedSyntax(f"no parser for tool syntax {tool_syntax!r}")
        if reasoning is not None:
            reasoning.implicit_close_ids = tools.opener_ids
    return OutputParser(reasoning, tools)
