"""Reasoning regions delimited by single-token open/close delimiters (<think> ... </think>)."""

from __future__ import annotations

from tokenizers import Tokenizer

from helios.frontend.events import ReasoningEvent, SemanticEvent, TextEvent
from helios.frontend.output import Piece

# Syntax name -> (open, close) delimiter spellings; each must be one token in the vocabulary.
DELIMITERS = {
    "qwen3": ("<think>", "</think>"),
    "think": ("<think>", "</think>"),
    "glm": ("<think>", "</think>"),
    "minimax_m3": ("<mm:think>", "</mm:think>"),
}


def reasoning_delimiters(syntax: str, tokenizer: Tokenizer) -> tuple[int, int] | None:
    spellings = DELIMITERS.get(syntax)
    if spellings is None:
        return None
    ids = [tokenizer.token_to_id(s) for s in spellings]
    return None if None in ids else (ids[0], ids[1])  # type: ignore[return-value]


def starts_in_reasoning(prompt_ids: tuple[int, ...], open_id: int, close_id: int) -> bool:
    """Whether the generation prompt pre-opens reasoning (e.g. ends with "<think>\n")."""
    tail = list(prompt_ids[-8:])
    if open_id not in tail:
        return False
    last_open = len(tail) - 1 - tail[::-1].index(open_id)
    return close_id not in tail[last_open:]


class ReasoningSplitter:
    """Routes text to reasoning or answer by delimiter *tokens*; spelled-out text stays text."""

    def __init__(self, open_id: int, close_id: int, prompt_ids: tuple[int, ...]) -> None:
        self.open_id, self.close_id = open_id, close_id
        self.implicit_close_ids: frozenset[int] = frozenset()  # tool openers that also end reasoning
        self.inside = starts_in_reasoning(prompt_ids, open_id, close_id)
        self.seen_open = self.inside

    def feed(self, piece: Piece) -> list[SemanticEvent]:
        entries = (piece.entry,) if piece.entry is not None else ()
        if piece.token_id == self.open_id and not self.seen_open:
            self.inside = self.seen_open = True
            return [ReasoningEvent("", entries)]
        if piece.token_id == self.close_id and self.inside:
            self.inside = False
            return [ReasoningEvent("", entries)]
        if piece.token_id in self.implicit_close_ids and self.inside:
            self.inside = False
        if self.inside:
            return [ReasoningEvent(piece.text, entries)]
        return [TextEvent(piece.text, entries)]
