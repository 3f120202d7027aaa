"""Anthropic Messages encoders for the server's driver, over the renderers in anthropic_messages.py.

The stream opens the message (message_start) with the first token, like Chat's role chunk,
and fills waits with ping events; the buffered encoder renders the accumulated blocks.
"""

from __future__ import annotations

from helios.frontend.events import FinishEvent
from helios.frontend.generate import ChoiceUpdate, Submission
from helios.frontend.inference import Termination
from helios.protocols.anthropic_messages import MessagesStream, message_json, sse
from helios.protocols.encoding import BufferedEvents, json_body
from helios.protocols.errors import anthropic_error


class MessagesEncoder:
    """Named SSE events of one message (n is always 1)."""

    def __init__(self, run: Submission, model: str) -> None:
        self.run = run
        prompt = run.generations[0].prompt
        self.events = MessagesStream(run.request_id, model, len(prompt.token_ids), prompt.image_tokens)
        self._started = False
        self._finish: FinishEvent | None = None

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> list[bytes]:
        return [sse("ping", {"type": "ping"})]

    def push(self, update: ChoiceUpdate) -> list[bytes]:
        out = []
        if not self._started:  # message_start waits for the first token
            self._started = True
            out += self.events.start()
        out += self.events.push(list(update.events))
        self._finish = update.finish or self._finish
        return [sse(name, data) for name, data in out]

    def finish(self) -> list[bytes]:
        events = self.events.finish(self._finish or FinishEvent(Termination.EOS), self.run.usage())
        return [sse(name, data) for name, data in events]

    def error(self, status: int, message: str) -> list[bytes]:
        return [sse(name, data) for name, data in self.events.error(status, message)]


class MessagesBuffer(BufferedEvents):
    """The buffered message."""

    error_body = staticmethod(anthropic_error)

    def __init__(self, run: Submission, model: str) -> None:
        super().__init__()
        self.run, self.model = run, model

    def finish(self) -> list[bytes]:
        return [json_body(message_json(self.run.request_id, self.model, self._blocks, self.run.usage()))]


def encoder(run: Submission, model: str) -> MessagesEncoder | MessagesBuffer:
    return MessagesEncoder(run, model) if run.request.stream else MessagesBuffer(run, model)
