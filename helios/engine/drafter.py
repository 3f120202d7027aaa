"""Draft proposals for speculative decoding, and how many to offer.

The history drafter needs no model: coding agents re-emit what their context holds (files
they edit, JSON they were shown, earlier turns), so the tokens that followed the most
recent earlier occurrence of the sequence's last n tokens are a good guess at what comes
next. It looks in the sequence itself (prompt and output) and then in the shared decoded
history of the serving process (recent outputs of other requests of the same cache
identity: one tenant's outputs never draft another's).

Drafts never change what is generated: the engine verifies them against the target model
(engine.py), so a bad guess costs only the rows it occupied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

NGRAM_SIZES = (4, 3, 2)  # longest match first: longer contexts predict better


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    mode: str = "adaptive"  # "off" | "adaptive" (depth follows acceptance) | "fixed" (always max_drafts, tests)
    max_drafts: int = 6  # draft tokens per sequence and round
    row_budget: int | None = 8  # adaptive: decode rows + drafts per step; at or past it no drafts (compute-bound);
    # None: measured at startup (threads.measure_row_budget)
    shared_history: bool = True  # draft from other requests' recent outputs (same cache identity) too
    history_tokens: int = 1 << 16  # shared history kept, in tokens


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a token list last ended, kept up to date as the list grows.

    `latest[n][gram]` is the end (exclusive) of the most recent occurrence that ends before
    the list's last token, so a lookup of the list's own suffix finds an earlier one."""

    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=lambda: {n: {} for n in NGRAM_SIZES})
    indexed: int = 0  # n-grams ending at positions < indexed are in `latest`

    def catch_up(self, tokens: list[int], upto: int) -> None:
        for end in range(max(self.indexed, 1), upto + 1):
            for n, table in self.latest.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def follow(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        length = len(tokens)
        self.catch_up(tokens, length - 1)  # every n-gram ending before the last token
        for n in NGRAM_SIZES:
            if length <= n:
                continue
            end = self.latest[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tuple(tokens[end : min(end + k, length)])
        return ()


class SharedHistory:
    """Recent decoded outputs of the serving process, per cache identity, bounded in tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: deque[tuple[bytes, list[int]]] = deque()
        self._tokens = 0
        self._index: dict[tuple[bytes, tuple[int, ...]], tuple[list[int], int]] = {}

    def add(self, identity: bytes, tokens: list[int]) -> None:
        if len(tokens) <= NGRAM_SIZES[-1] or self.max_tokens <= 0:
            return
        tokens = tokens[-self.max_tokens :]
        self._entries.append((identity, tokens))
        self._tokens += len(tokens)
        for n in NGRAM_SIZES:
            for end in range(n, len(tokens)):
                self._index[(identity, tuple(tokens[end - n : end]))] = (tokens, end)
        while self._tokens > self.max_tokens:
            _, old = self._entries.popleft()
            self._tokens -= len(old)
        if len(self._index) > 4 * self.max_tokens:  # entries of evicted outputs: rebuild from what is kept
            self._index = {}
            kept, self._entries, self._tokens = list(self._entries), deque(), 0
            for ident, toks in kept:
                self.add(ident, toks)

    def follow(self, identity: bytes, tokens: list[int], k: int) -> tuple[int, ...]:
        for n in NGRAM_SIZES:
            if len(tokens) < n:
                continue
            hit = self._index.get((identity, tuple(tokens[-n:])))
            if hit is not None:
                source, end = hit
                return tuple(source[end : end + k])
        return ()


class HistoryDrafter:
    """Proposes drafts for decode sequences and adapts each one's depth to its acceptance."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.shared = SharedHistory(config.history_tokens if config.shared_history else 0)
        self._indexes: dict[int, NgramIndex] = {}  # id(seq) -> its index (dropped when it finishes)

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off" and self.config.max_drafts > 0

    def depth(self, seq, limit: int) -> int:
        """Drafts to try for seq this round, at most `limit`."""
        if self.config.mode == "fixed":
            return min(self.config.max_drafts, limit)
        return max(0, min(int(seq.draft_depth), self.config.max_drafts, limit))

    def propose(self, seq, k: int) -> tuple[int, ...]:
        if k <= 0:
            return ()
        index = self._indexes.get(id(seq))
        if index is None:
            index = self._indexes[id(seq)] = NgramIndex()
        drafts = index.follow(seq.token_ids, k)
        if not drafts and self.config.shared_history:
            drafts = self.shared.follow(seq.request.cache_identity, seq.token_ids, k)
        return drafts

    def accepted(self, seq, offered: int, accepted: int) -> None:
        """Adaptive depth: one more than last round's accepted run, growing while all are accepted."""
        if offered == 0 or self.config.mode == "fixed":
            return
        seq.draft_depth = float(min(self.config.max_drafts, offered + 2 if accepted == offered else accepted + 1))

    def finished(self, seq) -> None:
        self._indexes.pop(id(seq), None)
        if self.config.shared_history and seq.num_output > 0:
            self.shared.add(seq.request.cache_identity, seq.token_ids[seq.num_prompt :])
