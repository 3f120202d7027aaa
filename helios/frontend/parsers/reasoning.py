"""Reasoning regions: routes encoded text to reasoning or answer between delimiters.

A delimiter part that the tokenizer has as one token acts only as that token (spelled-out
text stays text); multi-part delimiters such as Gemma 4's <|channel>thought are matched on
the text with hold-back. Reasoning opens at most once per output.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from helios.frontend.output import TokenEntry
from helios.frontend.parsers.markup import Marks, Span, find_earliest, partial_tail

_PROMPT_TAIL = 8  # prompt tokens inspected for a reasoning region the generation prompt opened


@dataclass(frozen=True, slots=True)
class Delimiters:
    open: tuple[str, ...]  # parts: token spellings or plain text, matched in sequence
    close: tuple[str, ...]
    strip: tuple[tuple[str, ...], ...] = ()  # answer-region wrappers that are markup, not text
    skip_newline: bool = False  # one newline right after the opener is markup too

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.open + self.close + tuple(part for wrapper in self.strip for part in wrapper)


_THINK = Delimiters(("<think>",), ("</think>",))
SYNTAXES = {
    "qwen3": _THINK,
    "think": _THINK,
    "glm": _THINK,
    "deepseek": _THINK,
    "minimax_m3": Delimiters(("<mm:think>",), ("</mm:think>",)),  # a bare </mm:think> (no thinking) shows nothing
    "gemma4": Delimiters(("<|channel>", "thought"), ("<channel|>",), skip_newline=True),
    "kimi3": Delimiters(
        ("<|open|>", "think", "<|sep|>"),
        ("<|close|>", "think", "<|sep|>"),
        strip=(
            ("<|open|>", "response", "<|sep|>"),
            ("<|close|>", "response", "<|sep|>"),
            ("<|close|>", "message", "<|sep|>"),
        ),
    ),
}


def close_token(syntax: str, tokenizer: Tokenizer) -> int | None:
    """The id of the syntax's close delimiter where it is one token: what thinking_token_budget
    forces at its cap (Qwen's </think>, Gemma 4's <channel|>; not Kimi K3's three-part close)."""
    delimiters = SYNTAXES.get(syntax)
    if delimiters is None or len(delimiters.close) != 1:
        return None
    return tokenizer.token_to_id(delimiters.close[0])


def prompt_opens(delimiters: Delimiters, marks: Marks, tokenizer: Tokenizer, prompt_ids: tuple[int, ...]) -> bool:
    """Whether the generation prompt leaves reasoning open, so output starts inside it: its tail
    has an opener (of any parts) with no close after it."""
    tail = marks.encode_ids(tokenizer, prompt_ids[-_PROMPT_TAIL:])
    opened = tail.rfind(marks.pattern(delimiters.open))
    return opened >= 0 and opened >= tail.rfind(marks.pattern(delimiters.close))


def token_delimiters(syntax: str, tokenizer: Tokenizer) -> tuple[int, int] | None:
    """(open, close) ids when the syntax's delimiters are one part each and single tokens.

    Structured output needs both; a reasoning budget needs only the close (`close_token`).
    """
    delimiters = SYNTAXES.get(syntax)
    if delimiters is None or len(delimiters.open) != 1 or len(delimiters.close) != 1:
        return None
    ids = [tokenizer.token_to_id(delimiters.open[0]), tokenizer.token_to_id(delimiters.close[0])]
    return None if None in ids else (ids[0], ids[1])  # type: ignore[return-value]


def starts_in_reasoning(prompt_ids: tuple[int, ...], open_id: int, close_id: int) -> bool:
    """Whether the generation prompt pre-opens reasoning (e.g. ends with "<think>\n")."""
    tail = list(prompt_ids[-8:])
    if open_id not in tail:
        return False
    last_open = len(tail) - 1 - tail[::-1].index(open_id)
    return close_id not in tail[last_open:]


class ReasoningSplitter:
    """Splits encoded pieces into reasoning and text spans (see module docstring)."""

    def __init__(self, delimiters: Delimiters, marks: Marks, tokenizer: Tokenizer, prompt_ids: tuple[int, ...]) -> None:
        self.open, self.close = marks.pattern(delimiters.open), marks.pattern(delimiters.close)
        self.strip = tuple(marks.pattern(wrapper) for wrapper in delimiters.strip)
        self.skip_newline = delimiters.skip_newline
        self.close_id = marks.token_id(delimiters.close[0]) if len(delimiters.close) == 1 else None
        self.implicit_close_ids: frozenset[int] = frozenset()  # opener tokens that also end reasoning
        self.inside = prompt_opens(delimiters, marks, tokenizer, prompt_ids)
        self.seen_open = self.inside
        self._newline_due = False  # the opener's newline may still come
        self._held = ""  # a possible delimiter's start
        self._held_entries: tuple[TokenEntry, ...] = ()  # entries of the tokens that wrote it

    def feed(self, text: str, entries: tuple[TokenEntry, ...], token_id: int = -1) -> list[Span]:
        """Spans of one piece; entries go with the first span (held with held text)."""
        if token_id in self.implicit_close_ids and self.inside:
            self.inside = False
        spans: list[Span] = []
        buf, self._held = self._held + text, ""
        entries, self._held_entries = self._held_entries + entries, ()
        while buf:
            buf = self._step(buf, spans)
        if not spans:
            if self._held:
                self._held_entries = entries
                return []
            return [Span(self.kind, "", entries)]
        spans[0] = Span(spans[0].kind, spans[0].text, entries)
        return spans

    def flush(self) -> list[Span]:
        """At the end of output a partial delimiter is plain text of its region."""
        held, self._held = self._held, ""
        entries, self._held_entries = self._held_entries, ()
        return [Span(self.kind, held, entries)] if held or entries else []

    def end(self) -> None:
        """Reasoning ended without its delimiter (a tool call started)."""
        self.inside, self._newline_due = False, False

    @property
    def kind(self) -> str:
        return "reasoning" if self.inside else "text"

    def _step(self, buf: str, spans: list[Span]) -> str:
        """Route the start of buf; return what remains (empty once all is routed or held)."""
        if self.inside and self._newline_due:
            self._newline_due = False
            buf = buf[1:] if buf.startswith("\n") else buf
            if not buf:
                return ""
        patterns = (self.close,) if self.inside else self.strip + (() if self.seen_open else (self.open,))
        found = find_earliest(buf, patterns)
        hold = partial_tail(buf, patterns) if found is None else None
        end = found[0] if found else len(buf) if hold is None else hold
        if end:
            spans.append(Span(self.kind, buf[:end]))
        if found is None:
            self._held = buf[end:]
            return ""
        at, pattern = found
        if pattern == self.close and self.inside:
            self.inside = False
            spans.append(Span("reasoning", ""))
        elif pattern == self.open and not self.inside and not self.seen_open:
            self.inside = self.seen_open = True
            self._newline_due = self.skip_newline
            spans.append(Span("reasoning", ""))
        return buf[at + len(pattern) :]
