"""The encoder interface every protocol implements for the server's one stream driver.

The driver calls `start`, then `push` for each choice update (and `keepalive` during long
waits), then `finish` once every choice has ended, or `error` instead of the rest. Each
returns the frames to send: SSE events when streaming. A buffered encoder returns nothing
until `finish` (or `error`), which returns the whole JSON body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import msgspec

from helios.frontend.events import Accumulator
from helios.frontend.generate import ChoiceUpdate

KEEPALIVE_COMMENT = b": keepalive\n\n"


class Encoder(Protocol):
    def start(self) -> list[bytes]:
        """Frames due before any output (Responses announces the response at once)."""
        ...

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        """Frames for one choice update that carries no error."""
        ...

    def finish(self) -> list[bytes]:
        """The closing frames, or the buffered body; may raise OutputValidationError."""
        ...

    def error(self, status: int, message: str) -> list[bytes]:
        """A terminal error event (streams) or the error body (buffered)."""
        ...

    def keepalive(self) -> list[bytes]:
        """What fills a long wait: an SSE comment, a Messages ping, nothing when buffered."""
        ...


class OutputValidationError(ValueError):
    """Model output that breaks a declared contract: the response fails (HTTP 500, not a client error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def json_body(body: Any) -> bytes:
    return msgspec.json.encode(body)


def data_frame(body: Any) -> bytes:
    """An unnamed SSE event (OpenAI Chat and Completions)."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class Buffered:
    """The shared half of a buffered encoder: no frames until `finish`; a failure is the whole
    error body, in the protocol's shape (`error_body = staticmethod(openai_error)` or anthropic_error)."""

    error_body: ClassVar[Callable[[int, str], dict[str, Any]]]

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> list[bytes]:
        return []

    def error(self, status: int, message: str) -> list[bytes]:
        return [json_body(self.error_body(status, message))]


class BufferedEvents(Buffered):
    """A buffered encoder that renders the accumulated events (Messages, Responses)."""

    def __init__(self) -> None:
        self._blocks = Accumulator()

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        for event in update.events:
            self._blocks.push(event)
        return []
