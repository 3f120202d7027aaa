"""The tool-call engine every syntax shares: finds call envelopes in the held text stream.

A syntax (one module per family) names its openers, decides whether an opener really starts
a call, and parses one complete call. The engine holds text back while an opener is
undecided, buffers each envelope until it is complete, drops the whitespace separating calls
from text, and, where the syntax allows calls in reasoning, ends reasoning at a call.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

from helios.frontend.events import ToolCallEvent
from helios.frontend.parsers.markup import (
    BOUNDARY,
    FAIL,
    MORE,
    Held,
    Marks,
    Span,
    find_earliest,
    lit,
    partial_tail,
    skip_space,
)
from helios.frontend.parsers.schema import ToolSchemas

MAX_ARGUMENT_BYTES = 8 << 20
CONFIRM = 0  # decide(): the opener starts a call (MORE: undecided, FAIL: it is text)
_call_ids = itertools.count()

OUTSIDE, BLOCK, CALL = "outside", "block", "call"


class ToolCallError(ValueError):
    """The model wrote a malformed or incomplete tool call."""


def new_call_id() -> str:
    return f"call_{next(_call_ids):012x}"


def make_call(name: str, arguments: object) -> ToolCallEvent:
    """A validated call: nonempty name, JSON-object arguments of at most 8 MiB."""
    name = name.strip()
    if not name:
        raise ToolCallError("tool call needs a nonempty name")
    if not isinstance(arguments, dict):
        raise ToolCallError("tool call arguments must be a JSON object")
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise ToolCallError(f"tool call arguments are not JSON: {exc}") from None
    if len(text.encode()) > MAX_ARGUMENT_BYTES:
        raise ToolCallError("tool call arguments exceed 8 MiB")
    return ToolCallEvent(new_call_id(), name, text)


def put_argument(arguments: dict[str, object], key: str, value: object) -> None:
    if not key:
        raise ToolCallError("tool call argument needs a nonempty name")
    if key in arguments:
        raise ToolCallError(f"tool call repeats argument {key!r}")
    arguments[key] = value


class ToolParser:
    """Engine state; subclasses fill in the syntax hooks and class attributes."""

    scans_reasoning = False  # an opener in reasoning starts a call and ends reasoning (Qwen)
    call_open = ""  # inside a block: what starts each call
    call_close = ""  # what completes a call
    block_close = ""  # what ends a block; also completes an open call, and is dropped when stray

    def __init__(self, marks: Marks, schemas: ToolSchemas) -> None:
        self.marks, self.schemas = marks, schemas
        self.opener_ids: frozenset[int] = frozenset()  # opener tokens that end reasoning at once (none here)
        self.ended_reasoning = False  # a call found in reasoning ended it
        self.held = Held()
        self.state = OUTSIDE
        self.in_block = False
        self.block_calls = 0  # calls completed in the current block
        self.after_call = False  # whitespace and a stray block close are dropped here
        self.undecided = False  # an opener waits for text that decides it
        self._searched = 0  # CALL: no close tag ends before this offset

    # The syntax.
    def openers(self, kind: str) -> tuple[str, ...]:
        """Encoded openers that may start a call in a region ("text" or "reasoning")."""
        raise NotImplementedError

    def decide(self, buf: str, i: int, opener: str) -> int:
        """Whether the opener at buf[i] starts a call: CONFIRM, MORE, or FAIL."""
        return CONFIRM

    def opens_block(self, opener: str) -> bool:
        return False

    def parse_call(self, body: str) -> tuple[str, dict[str, object]]:
        """(name, arguments) of a complete call's encoded text, close tag excluded."""
        raise NotImplementedError

    # The engine.
    def feed(self, spans: Iterable[Span]) -> list[Span | ToolCallEvent]:
        for span in spans:
            if self.ended_reasoning and span.kind == "reasoning":
                span = Span("text", span.text, span.entries)
            self.held.push(span)
        out: list[Span | ToolCallEvent] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self, truncated: bool) -> list[Span | ToolCallEvent]:
        """Flush at the end of generation; an unfinished call is omitted when truncated, else an error."""
        out: list[Span | ToolCallEvent] = []
        while self._step(out, final=True):
            pass
        rest = self.held.text.strip()
        if self.state == OUTSIDE and not self.undecided:
            return out
        if self.state == BLOCK and self.block_calls and self.block_close.startswith(rest):
            self.held.drop(self.held.length)
            return out
        if not truncated:
            raise ToolCallError("the model ended inside an unfinished tool call")
        self.held.drop(self.held.length)  # a truncated envelope is omitted; the response reports the limit
        self.state, self.undecided = OUTSIDE, False
        return out

    def _step(self, out: list[Span | ToolCallEvent], final: bool) -> bool:
        if self.state == CALL:
            return self._call(out)
        if self.state == BLOCK:
            return self._block()
        return self._outside(out, final)

    def _outside(self, out: list[Span | ToolCallEvent], final: bool) -> bool:
        buf = self.held.text
        self.undecided = False
        if self.after_call:
            lead = skip_space(buf, 0)
            self.held.drop(lead)
            buf = self.held.text
            if not buf:
                return False
            closed = lit(buf, 0, self.block_close) if self.block_close else FAIL
            if closed >= 0:
                self.held.drop(closed)
                return True
            if closed == MORE and not final:
                return False
            self.after_call = False
        found = self._candidate(buf)
        if found is None:
            tail = None if final else partial_tail(buf, self.openers("text") + self.openers("reasoning"))
            self._release(out, len(buf) if tail is None else tail, hold_space=not final)
            return False
        at, opener = found
        decision = self.decide(buf, at, opener)
        if decision == FAIL:
            self._release(out, at + 1, hold_space=False)
            return True
        kept = self._release(out, at, hold_space=True)
        if decision == MORE:
            self.undecided = True
            return False
        self.held.drop(at - kept)  # whitespace between text and a call belongs to neither
        if self.held.kind_at(0) == "reasoning":
            self.ended_reasoning = True
            self.held.relabel(0, "text")
        if self.opens_block(opener):
            self.held.drop(len(opener))
            self.state, self.in_block, self.block_calls = BLOCK, True, 0
        else:
            self.state, self.in_block, self._searched = CALL, False, 0
        return True

    def _candidate(self, buf: str) -> tuple[int, str] | None:
        """The earliest opener allowed in the region where it stands."""
        start = 0
        everywhere = tuple(dict.fromkeys(self.openers("text") + self.openers("reasoning")))
        while (found := find_earliest(buf, everywhere, start)) is not None:
            if found[1] in self.openers(self.held.kind_at(found[0])):
                return found
            start = found[0] + 1
        return None

    def _release(self, out: list[Span | ToolCallEvent], n: int, hold_space: bool) -> int:
        """Emit held text before offset n; trailing whitespace may wait for what follows."""
        cut = len(self.held.text[:n].rstrip()) if hold_space else n
        out.extend(span for span in self.held.take(cut) if span.text or span.entries)
        return cut

    def _block(self) -> bool:
        self.held.drop(skip_space(self.held.text, 0))
        buf = self.held.text
        if not buf:
            return False
        opened = lit(buf, 0, self.call_open)
        if opened >= 0:
            self.state, self._searched = CALL, 0
            return True
        closed = lit(buf, 0, self.block_close) if self.block_close else FAIL
        if closed >= 0:
            self.held.drop(closed)
            self.state, self.in_block, self.after_call = OUTSIDE, False, True
            return True
        if MORE in (opened, closed):
            return False
        if not self.block_calls:
            raise ToolCallError("malformed tool call block")
        self.state, self.in_block = OUTSIDE, False  # the block's close was omitted: text resumes
        return True

    def _call(self, out: list[Span | ToolCallEvent]) -> bool:
        ends = tuple(tag for tag in (self.call_close, self.block_close) if tag)
        start = max(0, self._searched - max(map(len, ends)) + 1)  # a tag may straddle pieces
        found = find_earliest(self.held.since(start), ends)
        if found is None:
            if self.held.length > MAX_ARGUMENT_BYTES:
                raise ToolCallError("tool call arguments exceed 8 MiB")
            self._searched = self.held.length
            return False
        end, tag = start + found[0], found[1]
        name, arguments = self.parse_call(self.held.text[:end].replace(BOUNDARY, ""))
        out.append(make_call(name, arguments))
        self.held.drop(end + len(tag) if tag == self.call_close else end)
        if self.in_block:
            self.state, self.block_calls = BLOCK, self.block_calls + 1
        else:
            self.state, self.after_call = OUTSIDE, True
        return True
