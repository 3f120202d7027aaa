"""Replays output-parser cases over many random piece groupings: streaming must equal buffered.

A case is a sequence of segments: `Tok("<tool_call>")` is that delimiter generated as its one
token; a plain string is text generated as ordinary pieces (so spelled-out delimiters stay
ordinary). Each replay cuts the text into random pieces and delays some released text onto
later tokens, as the output pipeline's hold-back does, delimiter tokens included.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer

from helios.frontend.events import Accumulator, ReasoningEvent, SemanticEvent, TextEvent
from helios.frontend.inference import ToolSpec
from helios.frontend.output import Piece, TokenEntry
from helios.frontend.parsers import OutputParser, build_parser
from helios.frontend.parsers.tools import ToolCallError

GROUPINGS = 120


@dataclass(frozen=True)
class Tok:
    """A delimiter generated as its single token."""

    spelling: str


Segment = str | Tok
Block = tuple  # ("text" | "reasoning", text) or ("call", name, arguments)

TOOLS = (
    ToolSpec(
        "get_weather",
        "Weather",
        {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    ),
    ToolSpec(
        "set_flags",
        None,
        {
            "type": "object",
            "properties": {
                "on": {"type": "boolean"},
                "ratio": {"type": "number"},
                "note": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"type": "integer"}},
                "opts": {"$ref": "#/$defs/Opts"},
            },
            "$defs": {"Opts": {"type": "object", "properties": {"k": {"type": "string"}}}},
        },
    ),
)


@dataclass(frozen=True)
class ParserFactory:
    """A fresh output parser per replay (`factory()`), and the tokenizer a case's segments are
    tokenized with."""

    tokenizer: Tokenizer
    make: Callable[[], OutputParser]

    def __call__(self) -> OutputParser:
        return self.make()


def factory(
    tokenizer: Tokenizer,
    reasoning: str | None,
    tools: str | None,
    prompt: Sequence[Segment] = (),
    structured: bool = False,
) -> ParserFactory:
    """Parsers of the syntaxes after the generation prompt's tail `prompt`; `structured`: under an
    output constraint."""
    prompt_ids = tuple(
        i
        for part in prompt
        for i in (
            [tokenizer.token_to_id(part.spelling)]
            if isinstance(part, Tok)
            else tokenizer.encode(part, add_special_tokens=False).ids
        )
    )
    return ParserFactory(
        tokenizer,
        lambda: build_parser(tokenizer, reasoning, tools, prompt_ids, tools is not None, TOOLS, structured=structured),
    )


def _tokens(
    tokenizer: Tokenizer, segments: Sequence[Segment], rng: random.Random | None
) -> list[tuple[int, str, bool]]:
    """(token id, text it shows, is a delimiter) per token; ordinary text gets a non-delimiter id."""
    ordinary = tokenizer.token_to_id("a")
    added = tokenizer.get_added_tokens_decoder()
    out: list[tuple[int, str, bool]] = []
    for segment in segments:
        if isinstance(segment, Tok):
            token_id = tokenizer.token_to_id(segment.spelling)
            assert token_id is not None, segment
            out.append((token_id, "" if added[token_id].special else segment.spelling, True))
        elif rng is None:
            out.append((ordinary, segment, False))
        else:
            at = 0
            while at < len(segment):
                size = rng.randint(1, 5)
                out.append((ordinary, segment[at : at + size], False))
                at += size
    return out


def _pieces(tokens: list[tuple[int, str, bool]], rng: random.Random | None) -> list[Piece]:
    """Held-back text lands on a later token, at the latest on the next delimiter token: text
    released with a token precedes it (text held past a delimiter would be indistinguishable
    from text generated after it)."""
    pieces: list[Piece] = []
    carry = ""
    for index, (token_id, text, delimiter) in enumerate(tokens):
        entry = TokenEntry(token_id, text, (), -float(index), ())
        if rng is not None and index < len(tokens) - 1 and not delimiter and rng.random() < 0.25:
            carry += text  # held back: released with a later token
            pieces.append(Piece(token_id, "", entry))
        else:
            pieces.append(Piece(token_id, carry + text, entry))
            carry = ""
    return pieces


def replay(make: Callable[[], OutputParser], pieces: list[Piece], truncated: bool) -> list[Block]:
    parser = make()
    events: list[SemanticEvent] = []
    for piece in pieces:
        fed = parser.feed(piece)
        assert sum(isinstance(e, ReasoningEvent) for e in fed) <= 1, "reasoning usage counts one event per token"
        events += fed
    events += parser.finish(truncated)
    order = [entry.logprob for e in events if isinstance(e, (TextEvent, ReasoningEvent)) for entry in e.entries]
    assert order == sorted(order, reverse=True), "logprob entries keep token order"
    accumulator = Accumulator()
    for event in events:
        accumulator.push(event)
    return [
        (b.kind, b.text) if b.call is None else ("call", b.call.name, json.loads(b.call.arguments))
        for b in accumulator.blocks
        if b.text or b.call
    ]


def check(make: ParserFactory, segments: Sequence[Segment], expected: list[Block], truncated: bool = False) -> None:
    """The buffered result is `expected`, and every random grouping streams to the same blocks."""
    tokenizer = make.tokenizer
    buffered = replay(make, _pieces(_tokens(tokenizer, segments, None), None), truncated)
    assert buffered == expected, f"buffered {buffered} != expected {expected}"
    rng = random.Random(repr(segments))
    for _ in range(GROUPINGS):
        pieces = _pieces(_tokens(tokenizer, segments, rng), rng)
        streamed = replay(make, pieces, truncated)
        assert streamed == buffered, f"streamed {streamed} != buffered {buffered} for pieces {[p.text for p in pieces]}"


def check_error(make: ParserFactory, segments: Sequence[Segment], match: str, truncated: bool = False) -> None:
    """Every grouping fails with a tool-call error."""
    rng = random.Random(repr(segments))
    for grouping in range(GROUPINGS + 1):
        source = None if grouping == 0 else rng
        with pytest.raises(ToolCallError, match=match):
            replay(make, _pieces(_tokens(make.tokenizer, segments, source), source), truncated)
