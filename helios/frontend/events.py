"""Neutral semantic output events (what every protocol encodes) and the ordered accumulator.

A choice's output is a sequence of blocks: answer text, reasoning, and tool calls, in
the order the model produced them. Streams encode the events as they come; buffered
responses encode the accumulated blocks. Both see the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from helios.frontend.inference import Termination, ToolCallPart
from helios.frontend.output import TokenEntry


@dataclass(frozen=True, slots=True)
class TextEvent:
    text: str
    entries: tuple[TokenEntry, ...] = ()  # logprob entries of tokens whose first byte is answer text


@dataclass(frozen=True, slots=True)
class ReasoningEvent:
    text: str
    entries: tuple[TokenEntry, ...] = ()


# A call the model makes is the value a later turn sends back: one type for both.
ToolCallEvent = ToolCallPart


@dataclass(frozen=True, slots=True)
class FinishEvent:
    termination: Termination
    matched_stop: str | None = None
    error: str | None = None


SemanticEvent = Union[TextEvent, ReasoningEvent, ToolCallEvent, FinishEvent]


@dataclass
class Block:
    kind: str  # "text" | "reasoning" | "tool_call"
    text: str = ""
    entries: list[TokenEntry] = field(default_factory=list)
    call: ToolCallEvent | None = None


@dataclass
class Accumulator:
    """The ordered blocks of one choice; consecutive text (or reasoning) events merge."""

    blocks: list[Block] = field(default_factory=list)
    finish: FinishEvent | None = None
    all_entries: list[TokenEntry] = field(default_factory=list)  # every token's entry, in order

    def push(self, event: SemanticEvent) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
        elif isinstance(event, ToolCallEvent):
            self.blocks.append(Block("tool_call", call=event))
        else:
            kind = "text" if isinstance(event, TextEvent) else "reasoning"
            if not event.text and not event.entries:
                return
            if not self.blocks or self.blocks[-1].kind != kind:
                self.blocks.append(Block(kind))
            self.blocks[-1].text += event.text
            self.blocks[-1].entries += event.entries

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def reasoning(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCallEvent]:
        return [b.call for b in self.blocks if b.call is not None]
