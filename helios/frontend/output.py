"""One choice's output pipeline: engine events in, text deltas with logprob entries out.

Hides terminating EOS / token-stop tokens and special tokens, holds back text that may
start a stop string (and tokens that may start a stop sequence), and cuts at a match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from helios.engine import EngineEvent, FinishCause, TokenLogprobs
from helios.frontend.detokenizer import IncrementalDecoder, TokenBytes
from helios.frontend.inference import LogprobOptions, StopOptions, Termination

_TERMINATIONS = {
    FinishCause.EOS: Termination.EOS,
    FinishCause.STOP_TOKEN: Termination.STOP_TOKEN,
    FinishCause.LENGTH: Termination.LENGTH,
    FinishCause.ABORT: Termination.ABORT,
    FinishCause.ERROR: Termination.ERROR,
}


@dataclass(frozen=True, slots=True)
class Alternative:
    token_id: int
    token: str  # decoded text (U+FFFD for partial UTF-8) or "token_id:<id>"
    bytes: tuple[int, ...]  # the token's exact bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEntry:
    token_id: int
    token: str  # as Alternative.token
    bytes: tuple[int, ...]  # exact, even when a string stop clips the token's text
    logprob: float
    top: tuple[Alternative, ...]  # in engine reporting order


@dataclass(frozen=True, slots=True)
class Piece:
    """What one settled token released: the unit output parsers consume."""

    token_id: int
    text: str  # text released while settling this token (held-back text lands on a later token)
    entry: TokenEntry | None  # its logprob entry, when requested


@dataclass(frozen=True, slots=True)
class OutputDelta:
    text: str  # may be empty while entries are not (incomplete UTF-8, held-back text)
    entries: tuple[TokenEntry, ...]  # empty unless generation logprobs were requested
    token_ids: tuple[int, ...]  # tokens settled by this event, terminating EOS / stop tokens included
    finish: Termination | None  # set on the choice's last delta only
    matched_stop: str | None  # the stop string, when finish is STOP_STRING
    error: str | None  # the engine's message, when finish is ERROR
    pieces: tuple[Piece, ...] = ()  # text and entries split by token; "".join(p.text) == text


class _StopStrings:
    """Matches stop strings on released text, withholding any suffix that could start one.

    The first stop to complete wins (ties: the earlier start), so the result does not
    depend on how the text was split into pieces.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text now safe to release, matched stop); on a match the text ends before it."""
        if not self._stops:
            return text, None
        buffer = self.held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self.held = ""
            return buffer[: best[1]], best[2]
        cut = len(buffer)
        for start in range(max(0, len(buffer) - self._longest + 1), len(buffer)):
            if any(stop.startswith(buffer[start:]) for stop in self._stops):
                cut = start
                break
        self.held = buffer[cut:]
        return buffer[:cut], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class ChoiceOutput:
    """Turns one choice's EngineEvents into OutputDeltas (see module docstring)."""

    def __init__(
        self,
        tokens: TokenBytes,
        stop: StopOptions,
        logprobs: LogprobOptions,
        eos_ids: frozenset[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokens = tokens
        self._logprobs = logprobs
        self._eos_ids = eos_ids
        self._skip_special = skip_special_tokens
        self._sequences = tuple(seq for seq in stop.token_sequences if len(seq) > 1)
        self._stops = _StopStrings(stop.strings)
        self._decoder = IncrementalDecoder()
        self._pending: list[tuple[int, TokenLogprobs | None]] = []  # may start a stop sequence
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._done = False
        self._needs_abort = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def num_generated(self) -> int:
        """Committed tokens for usage, including terminating EOS / stop tokens."""
        return len(self._token_ids) + len(self._pending)

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def needs_abort(self) -> bool:
        """A stop string ended the choice while the engine was still generating it."""
        return self._needs_abort

    def push(self, event: EngineEvent) -> OutputDelta:
        if self._done:
            return OutputDelta("", (), (), None, None, None)  # after a string stop
        logprobs = event.logprobs if self._logprobs.top is not None else None
        if logprobs is not None and len(logprobs) != len(event.token_ids):
            raise ValueError("event logprobs are not parallel to its token ids")
        self._pending.extend(zip(event.token_ids, logprobs or (None,) * len(event.token_ids)))
        terminal = 0  # trailing tokens that end the choice and show nothing
        if event.finish is FinishCause.EOS:
            terminal = min(1, len(self._pending))
        elif event.finish is FinishCause.STOP_TOKEN:
            terminal = min(event.stop_match_len, len(self._pending))
        ready = len(self._pending) - terminal if event.finish else self._num_safe()
        release, rest = self._pending[:ready], self._pending[ready:]
        text, entries, token_ids, matched, pieces = self._settle(release)
        if matched is not None:
            self._pending = []
            self._done = True
            self._needs_abort = event.finish is None
            return OutputDelta(text, entries, token_ids, Termination.STOP_STRING, matched, None, pieces)
        if event.finish is None:
            self._pending = rest
            return OutputDelta(text, entries, token_ids, None, None, None, pieces)
        self._pending = []
        self._done = True
        terminal_ids = tuple(token_id for token_id, _ in rest)
        self._token_ids.extend(terminal_ids)
        tail, matched = self._stops.feed(self._decoder.flush())
        if matched is None:
            tail += self._stops.flush()  # held text that never became a stop is output
        self._text.append(tail)
        if tail:
            last = pieces[-1] if pieces else Piece(token_ids[-1] if token_ids else -1, "", None)
            pieces = (
                pieces[:-1] + (Piece(last.token_id, last.text + tail, last.entry),)
                if pieces
                else (Piece(last.token_id, tail, None),)
            )
        finish = Termination.STOP_STRING if matched is not None else _TERMINATIONS[event.finish]
        return OutputDelta(text + tail, entries, token_ids + terminal_ids, finish, matched, event.error, pieces)

    def _num_safe(self) -> int:
        """Pending tokens that cannot be part of a stop sequence still being generated."""
        ids = [token_id for token_id, _ in self._pending]
        longest = max((len(seq) for seq in self._sequences), default=1)
        for size in range(min(len(ids), longest - 1), 0, -1):
            suffix = tuple(ids[-size:])
            if any(len(seq) > size and seq[:size] == suffix for seq in self._sequences):
                return len(ids) - size
        return len(ids)

    def _settle(
        self, items: Sequence[tuple[int, TokenLogprobs | None]]
    ) -> tuple[str, tuple[TokenEntry, ...], tuple[int, ...], str | None, tuple[Piece, ...]]:
        """Decode tokens in order until a stop string completes (later tokens are dropped)."""
        pieces: list[Piece] = []
        entries: list[TokenEntry] = []
        token_ids: list[int] = []
        matched: str | None = None
        for token_id, logprobs in items:
            token_ids.append(token_id)
            entry = self._entry(logprobs) if logprobs is not None else None
            if entry is not None:
                entries.append(entry)
            released, matched = self._stops.feed(self._decoder.push(self._visible_bytes(token_id)))
            pieces.append(Piece(token_id, released, entry))
            if matched is not None:
                break
        text = "".join(p.text for p in pieces)
        self._text.append(text)
        self._token_ids.extend(token_ids)
        return text, tuple(entries), tuple(token_ids), matched, tuple(pieces)

    def _visible_bytes(self, token_id: int) -> bytes:
        hidden = token_id in self._eos_ids or self._tokens.is_special(token_id)
        return b"" if self._skip_special and hidden else self._tokens.bytes_of(token_id)

    def _render(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        data = self._tokens.bytes_of(token_id)
        token = f"token_id:{token_id}" if self._logprobs.as_token_ids else data.decode("utf-8", errors="replace")
        return token, tuple(data)

    def _entry(self, logprobs: TokenLogprobs) -> TokenEntry:
        top = tuple(Alternative(alt_id, *self._render(alt_id), value) for alt_id, value in logprobs.alternatives)
        return TokenEntry(logprobs.token_id, *self._render(logprobs.token_id), logprobs.logprob, top)


def text_offsets(entries: Sequence[TokenEntry], start: int) -> list[int]:
    """Character offset of each entry's token: characters its predecessors released.

    Tokens inside one multi-token UTF-8 character share the offset where it starts.
    Counts every entry's bytes, hidden special tokens included (as vLLM does).
    """
    decoder = IncrementalDecoder()
    offsets: list[int] = []
    position = start
    for entry in entries:
        offsets.append(position)
        position += len(decoder.push(bytes(entry.bytes)))
    return offsets
