"""Markup shared by the output parsers: delimiter tokens as sentinel characters, held text.

Parsers match delimiters on one string. A delimiter the tokenizer has as a single added
token appears there as a private sentinel character, and only when that token was
generated; the same characters written in ordinary pieces stay plain text that no
delimiter pattern matches. Delimiters the vocabulary lacks are matched as plain text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from helios.frontend.output import TokenEntry

# Unicode noncharacters are reserved for process-internal use, so they make safe sentinels;
# the few a model might still write as text are replaced by U+FFFD before matching.
_FIRST_SENTINEL = 0xFDD0
_NUM_SENTINELS = 31
BOUNDARY = "\ufdef"  # where held text changes region (reasoning <-> answer): no markup spans it
_SCRUB = {code: 0xFFFD for code in range(_FIRST_SENTINEL, _FIRST_SENTINEL + _NUM_SENTINELS + 1)}

# Results of matching at a position, besides the position after the match.
MORE = -1  # the text ends before the pattern could be decided
FAIL = -2  # the pattern does not match here


class Marks:
    """Encodes pieces for matching: delimiter tokens become sentinels, text stays text."""

    def __init__(self, tokenizer: Tokenizer, spellings: Iterable[str]) -> None:
        added = tokenizer.get_added_tokens_decoder()
        self._by_id: dict[int, str] = {}
        self._by_spelling: dict[str, str] = {}
        self._shown: dict[int, str] = {ord(BOUNDARY): ""}  # sentinel -> text the output pipeline shows
        for spelling in dict.fromkeys(spellings):
            token_id = tokenizer.token_to_id(spelling)
            if token_id is None or token_id not in added:
                continue  # not one token: matched as text
            if len(self._by_id) == _NUM_SENTINELS:
                raise ValueError("too many delimiter tokens for one parser")
            mark = chr(_FIRST_SENTINEL + len(self._by_id))
            self._by_id[token_id], self._by_spelling[spelling] = mark, mark
            self._shown[ord(mark)] = "" if added[token_id].special else spelling

    def __getitem__(self, spelling: str) -> str:
        """How a delimiter appears in encoded text: its sentinel, or its spelling."""
        return self._by_spelling.get(spelling, spelling)

    def pattern(self, parts: Sequence[str]) -> str:
        """A delimiter written as several parts (tokens or text), e.g. ("<|channel>", "thought")."""
        return "".join(self[part] for part in parts)

    def token_id(self, spelling: str) -> int | None:
        mark = self._by_spelling.get(spelling)
        return next((i for i, m in self._by_id.items() if m == mark), None) if mark else None

    def encode(self, text: str, token_id: int) -> str:
        """One piece: text released with it (which precedes the token), then its sentinel."""
        text = text.translate(_SCRUB)
        mark = self._by_id.get(token_id)
        if mark is None:
            return text
        shown = self._shown[ord(mark)]
        if shown and text.endswith(shown):
            text = text[: -len(shown)]
        return text + mark

    def encode_ids(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
        """Token ids as encoded text (a prompt's tail, or output the engine asks about): each run of
        text tokens decoded at once, delimiter tokens as their sentinels."""
        parts: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            mark = self._by_id.get(token_id)
            if mark is None:
                run.append(token_id)
                continue
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False).translate(_SCRUB))
                run = []
            parts.append(mark)
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=False).translate(_SCRUB))
        return "".join(parts)

    def decode(self, text: str) -> str:
        """Encoded text as the output pipeline showed it."""
        return text.translate(self._shown)


def is_mark(char: str) -> bool:
    return _FIRST_SENTINEL <= ord(char) <= _FIRST_SENTINEL + _NUM_SENTINELS


def name_end(buf: str, i: int, limit: int = 256) -> int:
    """End of a run of name characters at buf[i:] (no whitespace, angle brackets or marks), or FAIL past limit."""
    j = i
    while j < len(buf) and not (buf[j].isspace() or buf[j] in "<>" or is_mark(buf[j])):
        j += 1
    return FAIL if j - i > limit else j


def lit(buf: str, i: int, pattern: str) -> int:
    """Match `pattern` at buf[i:]: the position after it, MORE, or FAIL."""
    if buf.startswith(pattern, i):
        return i + len(pattern)
    return MORE if pattern.startswith(buf[i:]) else FAIL


def first_of(buf: str, i: int, patterns: Iterable[str]) -> int:
    """Match whichever pattern fits at buf[i:]: position after it, MORE (one may still fit), FAIL."""
    results = [lit(buf, i, p) for p in patterns]
    return max(results)


def skip_space(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


def find_earliest(buf: str, patterns: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest full occurrence of any pattern at or after `start` (longest first on ties)."""
    best: tuple[int, str] | None = None
    for pattern in patterns:
        at = buf.find(pattern, start)
        if at >= 0 and (best is None or (at, -len(pattern)) < (best[0], -len(best[1]))):
            best = (at, pattern)
    return best


def partial_tail(buf: str, patterns: Iterable[str]) -> int | None:
    """Where a suffix of buf that is a proper prefix of some pattern starts (earliest)."""
    patterns = [p for p in patterns if p]
    if not patterns:
        return None
    firsts = {p[0] for p in patterns}
    for at in range(max(0, len(buf) - max(map(len, patterns)) + 1), len(buf)):
        if buf[at] in firsts:
            tail = buf[at:]
            if any(len(p) > len(tail) and p.startswith(tail) for p in patterns):
                return at
    return None


@dataclass
class Span:
    """A run of encoded text from one region, with the logprob entries of its tokens."""

    kind: str  # "text" | "reasoning"
    text: str
    entries: tuple[TokenEntry, ...] = ()


class Held:
    """Text held back while a parser decides; releases keep each token's entries in order.

    Pieces are appended in O(1) and joined only when a parser reads the whole text, so a
    long call body is not copied once per token.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.length = 0
        self.spans: list[tuple[int, Span]] = []  # (start offset, span), in order

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def since(self, start: int) -> str:
        """The text from offset `start` on, joining only the parts it covers."""
        parts: list[str] = []
        at = self.length
        for part in reversed(self._parts):
            if at <= start:
                break
            at -= len(part)
            parts.append(part)
        return "".join(reversed(parts))[start - at :]

    def push(self, span: Span) -> None:
        text = span.text
        if self.spans and self.length and self.spans[-1][1].kind != span.kind:
            text = BOUNDARY + text
        self.spans.append((self.length, Span(span.kind, text, span.entries)))
        self._parts.append(text)
        self.length += len(text)

    def kind_at(self, i: int) -> str:
        for start, span in self.spans:
            if start <= i < start + len(span.text):
                return span.kind
        return self.spans[-1][1].kind if self.spans else "text"

    def relabel(self, i: int, kind: str) -> None:
        """Everything from offset i on is `kind` (reasoning ended implicitly)."""
        self.spans = [(s, Span(kind, sp.text, sp.entries) if s + len(sp.text) > i else sp) for s, sp in self.spans]

    def take(self, n: int) -> list[Span]:
        """Remove the first n characters and return them as spans, merged by region."""
        out: list[Span] = []
        for span in self._cut(n):
            if out and out[-1].kind == span.kind:
                out[-1] = Span(span.kind, out[-1].text + span.text, out[-1].entries + span.entries)
            else:
                out.append(span)
        return out

    def drop(self, n: int) -> None:
        self._cut(n)

    def _cut(self, n: int) -> list[Span]:
        taken: list[Span] = []
        kept: list[tuple[int, Span]] = []
        for start, span in self.spans:
            if start >= n:  # an empty span at n goes with the text that follows it
                kept.append((start - n, span))
            elif start + len(span.text) <= n:
                taken.append(span)
            else:
                taken.append(Span(span.kind, span.text[: n - start], span.entries))
                kept.append((0, Span(span.kind, span.text[n - start :])))
        rest = self.text[n:]
        self._parts, self.length, self.spans = [rest] if rest else [], len(rest), kept
        return taken
