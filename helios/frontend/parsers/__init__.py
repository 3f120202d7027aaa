"""Output parsers: split a choice's tokens into answer text, reasoning and tool calls.

A parser consumes Pieces (one per settled token) and emits semantic events. Reasoning
and tool syntaxes are named by the core's recipe; `build_parser` assembles the parser a
request needs. Delimiters that are single tokens act only when generated as that token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer

from helios.frontend.events import ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.inference import ToolSpec
from helios.frontend.output import Piece
from helios.frontend.parsers import deepseek
from helios.frontend.parsers.markup import Marks, Span
from helios.frontend.parsers.reasoning import SYNTAXES as REASONING_SYNTAXES
from helios.frontend.parsers.reasoning import ReasoningSplitter
from helios.frontend.parsers.tools import ToolParser, tool_parser, tool_spellings


class UnsupportedSyntax(ValueError):
    """The core names a syntax this helios has no parser for."""


class ChoiceParser(Protocol):
    """What a choice's output pipeline drives: one settled piece at a time, then the end."""

    def feed(self, piece: Piece) -> list[SemanticEvent]: ...

    def finish(self, truncated: bool) -> list[SemanticEvent]: ...


@dataclass
class OutputParser:
    reasoning: ReasoningSplitter | None
    tools: ToolParser | None
    marks: Marks
    structured: bool = False  # under an output constraint: the answer is verbatim once it begins
    verbatim: bool = False  # answer text began under a constraint; no more markup is parsed

    def feed(self, piece: Piece) -> list[SemanticEvent]:
        entries = (piece.entry,) if piece.entry is not None else ()
        if self.verbatim:  # a structured answer may spell delimiter tokens; they are its text
            return [TextEvent(piece.text, entries)]
        text = self.marks.encode(piece.text, piece.token_id)
        was_inside = self.reasoning is not None and self.reasoning.inside
        spans = self.reasoning.feed(text, entries, piece.token_id) if self.reasoning else [Span("text", text, entries)]
        events = self._events(self.tools.feed(spans) if self.tools else spans)
        if self.reasoning is not None and self.tools is not None and self.tools.ended_reasoning:
            self.reasoning.end()
        # Usage counts the events that carry reasoning: exactly one per token read as reasoning.
        counted = was_inside or (self.reasoning is not None and self.reasoning.inside)
        if self.structured and any(isinstance(e, TextEvent) and e.text for e in events):
            self.verbatim = True
        return _one_reasoning_event(events, counted)

    def finish(self, truncated: bool) -> list[SemanticEvent]:
        if self.verbatim:
            return []
        spans = self.reasoning.flush() if self.reasoning else []
        if self.tools is None:
            return self._events(spans)
        return self._events(self.tools.feed(spans) + self.tools.finish(truncated))

    def _events(self, items: Iterable[Span | ToolCallEvent]) -> list[SemanticEvent]:
        events: list[SemanticEvent] = []
        for item in items:
            if isinstance(item, ToolCallEvent):
                events.append(item)
            elif item.kind == "reasoning":
                events.append(ReasoningEvent(self.marks.decode(item.text), item.entries))
            else:
                events.append(TextEvent(self.marks.decode(item.text), item.entries))
        return events


def _one_reasoning_event(events: list[SemanticEvent], counted: bool) -> list[SemanticEvent]:
    positions = [i for i, e in enumerate(events) if isinstance(e, ReasoningEvent)]
    if not positions:
        return [*events, ReasoningEvent("")] if counted else events
    if len(positions) == 1:
        return events
    parts = [events[i] for i in positions]
    merged = ReasoningEvent("".join(e.text for e in parts), tuple(x for e in parts for x in e.entries))  # type: ignore[union-attr]
    return [merged if i == positions[0] else e for i, e in enumerate(events) if i == positions[0] or i not in positions]


def build_parser(
    tokenizer: Tokenizer,
    reasoning_syntax: str | None,
    tool_syntax: str | None,
    prompt_ids: tuple[int, ...],
    tools_enabled: bool,
    tools: Iterable[ToolSpec] = (),
    structured: bool = False,
) -> ChoiceParser:
    """The parser of one choice; `tools` (the declared tools) guide argument conversion;
    `structured`: an output constraint shapes the answer (its text is then verbatim)."""
    if deepseek.REASONING_SYNTAX == reasoning_syntax or deepseek.TOOL_SYNTAX == tool_syntax:
        return _deepseek_parser(tokenizer, reasoning_syntax, tool_syntax, prompt_ids, tools_enabled, structured)
    delimiters = REASONING_SYNTAXES.get(reasoning_syntax) if reasoning_syntax else None
    if reasoning_syntax and delimiters is None:
        raise UnsupportedSyntax(f"no parser for reasoning syntax {reasoning_syntax!r}")
    tools_on = bool(tool_syntax) and tools_enabled
    if tools_on and not tool_spellings(tool_syntax or ""):
        raise UnsupportedSyntax(f"no parser for tool syntax {tool_syntax!r}")
    spellings = (delimiters.spellings if delimiters else ()) + (tool_spellings(tool_syntax or "") if tools_on else ())
    marks = Marks(tokenizer, spellings)
    reasoning = ReasoningSplitter(delimiters, marks, tokenizer, prompt_ids) if delimiters else None
    parser = tool_parser(tool_syntax or "", tokenizer, tools, marks) if tools_on else None
    return OutputParser(reasoning, parser, marks, structured)


def _deepseek_parser(
    tokenizer: Tokenizer,
    reasoning_syntax: str | None,
    tool_syntax: str | None,
    prompt_ids: tuple[int, ...],
    tools_enabled: bool,
    structured: bool,
) -> ChoiceParser:
    """DeepSeek's official state machine reads its reasoning and DSML calls together."""
    for kind, syntax, ours in (
        ("reasoning", reasoning_syntax, deepseek.REASONING_SYNTAX),
        ("tool", tool_syntax, deepseek.TOOL_SYNTAX),
    ):
        if syntax not in (None, ours):
            raise UnsupportedSyntax(f"no parser combines {kind} syntax {syntax!r} with DeepSeek's")
    reasoning = reasoning_syntax is not None
    tools_on = tool_syntax is not None and tools_enabled
    return deepseek.DeepseekParser(tokenizer, prompt_ids, reasoning, tools_on, structured)
