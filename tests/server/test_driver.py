"""The one stream driver: ordering, keepalives, failures, cancellation and the admission slot.

Fake runs feed hand-made choice updates to the real protocol encoders; the last test drives
a real engine and cancels the handler mid-stream, as a client disconnect does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from helios.config import ServerConfig
from helios.frontend.events import FinishEvent, TextEvent
from helios.frontend.generate import ChoiceUpdate, Submission
from helios.frontend.inference import (
    Conversation,
    InferenceRequest,
    Message,
    SamplingOptions,
    StopOptions,
    Termination,
    TextPart,
)
from helios.frontend.output import OutputDelta
from helios.protocols import anthropic_encoding, openai_chat, openai_chat_encoding
from helios.protocols.encoding import OutputValidationError
from helios.server import driver
from helios.server.driver import Drive
from helios.server.generation import start
from helios.server.outcomes import Outcome
from helios.server.state import build_state

CONVERSATION = Conversation((Message("user", (TextPart("hi"),)),))


def _request(stream: bool = True) -> InferenceRequest:
    return InferenceRequest(input=CONVERSATION, sampling=SamplingOptions(), max_tokens=8, stream=stream)


def _update(text: str, finish: Termination | None = None, error: str | None = None) -> ChoiceUpdate:
    events: tuple = (TextEvent(text),) if text else ()
    if finish is not None:
        events += (FinishEvent(finish, error=error),)
    return ChoiceUpdate(0, OutputDelta(text, (), (1,), finish, None, error), events, time.time())


@dataclass
class FakeRun:
    """The driver's view of a run, with the calls it makes counted."""

    request: InferenceRequest
    source: Callable[[], AsyncIterator[ChoiceUpdate]]
    headers: dict[str, str] = field(default_factory=lambda: {"x-request-id": "chatcmpl-test"})
    released: int = 0
    aborted: int = 0
    first: int = 0
    outcomes: list[Outcome | None] = field(default_factory=list)  # what each end() counted

    def updates(self) -> AsyncIterator[ChoiceUpdate]:
        return self.source()

    def first_output(self) -> None:
        self.first += 1

    def abort(self) -> None:
        self.aborted += 1

    def end(self, outcome: Outcome | None) -> None:
        self.released += 1
        self.outcomes.append(outcome)


def _chat_stream(request: InferenceRequest) -> openai_chat_encoding.ChatStream:
    _, options = openai_chat.decode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    return openai_chat_encoding.ChatStream(Submission(request, "chatcmpl-test", []), "flare", options)


async def _frames(drive: Drive) -> list[bytes]:
    return [frame async for frame in drive.frames()]


def _data(frames: list[bytes]) -> list:
    out = []
    for frame in frames:
        if frame.startswith(b"data: "):
            payload = frame[6:].strip()
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def test_role_chunk_follows_the_first_token_and_done_ends_the_stream() -> None:
    async def source():
        yield _update("Hel")
        yield _update("lo", Termination.EOS)

    run = FakeRun(_request(), source)
    chunks = _data(asyncio.run(_frames(Drive(run, _chat_stream(run.request)))))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["Hel", "lo"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"
    assert (run.released, run.first) == (1, 1)


def test_failure_before_the_first_token_is_only_an_error() -> None:
    async def source():
        yield _update("", Termination.ERROR, "device fault")

    run = FakeRun(_request(), source)
    chunks = _data(asyncio.run(_frames(Drive(run, _chat_stream(run.request)))))
    assert chunks == [{"error": {"type": "server_error", "message": "device fault", "param": None, "code": None}}]
    assert (run.released, run.first) == (1, 0)


def test_buffered_failure_sets_the_status() -> None:
    async def source():
        yield _update("partial")
        yield _update("", Termination.ERROR, "device fault")

    run = FakeRun(_request(stream=False), source)
    _, options = openai_chat.decode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    drive = Drive(run, openai_chat_encoding.ChatBuffer(Submission(run.request, "x", []), "flare", options, str))
    body = b"".join(asyncio.run(_frames(drive)))
    assert drive.status == 500 and json.loads(body)["error"]["message"] == "device fault"
    assert run.released == 1


def test_keepalives_fill_long_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "KEEPALIVE_SECONDS", 0.01)

    async def main() -> list[bytes]:
        waited = asyncio.Event()

        async def source():
            await waited.wait()  # the model is slow: nothing until a keepalive went out
            yield _update("ok", Termination.EOS)

        run = FakeRun(_request(), source)
        frames = []
        async for frame in Drive(run, _chat_stream(run.request)).frames():
            frames.append(frame)
            if frame == b": keepalive\n\n":
                waited.set()
        return frames

    frames = asyncio.run(main())
    assert frames[0] == b": keepalive\n\n" and frames[-1] == b"data: [DONE]\n\n"
    generation = SimpleNamespace(prompt=SimpleNamespace(token_ids=(1, 2), image_tokens=0))  # what message_start reads
    messages = anthropic_encoding.MessagesEncoder(Submission(_request(), "msg-x", [generation]), "flare")  # type: ignore[list-item]
    assert messages.keepalive() == [b'event: ping\ndata: {"type":"ping"}\n\n']  # Messages waits with pings


def test_encoder_exceptions_become_terminal_errors() -> None:
    class Failing:
        def start(self):
            return [b"start"]

        def keepalive(self):
            return []

        def push(self, update):
            raise OutputValidationError("custom tool 'x' input does not match its lark grammar")

        def finish(self):
            raise AssertionError("not reached")

        def error(self, status, message):
            return [f"{status} {message}".encode()]

    async def source():
        yield _update("x")

    run = FakeRun(_request(), source)
    frames = asyncio.run(_frames(Drive(run, Failing())))
    assert frames == [b"start", b"500 custom tool 'x' input does not match its lark grammar"]
    assert run.released == 1


def test_cancellation_closes_the_updates_and_releases_once() -> None:
    async def main() -> tuple[FakeRun, list[str]]:
        started, trace = asyncio.Event(), []

        async def source():
            try:
                started.set()
                await asyncio.Event().wait()  # the engine never answers
                yield _update("never")
            finally:
                trace.append("closed")

        run = FakeRun(_request(), source)
        task = asyncio.create_task(_frames(Drive(run, _chat_stream(run.request))))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return run, trace

    run, trace = asyncio.run(main())
    assert trace == ["closed"] and run.released == 1 and run.aborted == 1


def test_a_stream_abandoned_at_a_send_is_closed_after_the_response() -> None:
    """A disconnect while a frame is being sent leaves the frames suspended at a yield; the
    response's background step closes them (aborting the run) instead of the garbage collector."""

    async def main() -> tuple[FakeRun, list[str]]:
        trace: list[str] = []

        async def source():
            try:
                yield _update("Hel")
                await asyncio.Event().wait()
                yield _update("never")
            finally:
                trace.append("closed")

        run = FakeRun(_request(), source)
        stream = await driver.respond(run, _chat_stream(run.request))
        first = await stream.iterator.__anext__()  # type: ignore[union-attr]
        assert first.startswith(b"data: ") and run.released == 0
        await stream.background()  # type: ignore[misc] - what Litestar runs once the response ends
        return run, trace

    run, trace = asyncio.run(main())
    assert trace == ["closed"] and (run.released, run.aborted) == (1, 1)


# ---------------------------------------------------------------------------- a real engine
def test_cancelling_the_handler_aborts_the_engine_request(tiny_core: Path) -> None:
    state = build_state(tiny_core, ServerConfig(kv_pages=256))
    aborted: list[tuple] = []
    abort = state.client.abort
    state.client.abort = lambda *args: (aborted.append(args), abort(*args))  # type: ignore[method-assign]

    async def main():
        request = InferenceRequest(
            input=CONVERSATION,
            sampling=SamplingOptions(),
            max_tokens=1000,
            stream=True,
            stop=StopOptions(ignore_eos=True),
        )
        run = await start(state, request, "chatcmpl")
        _, options = openai_chat.decode({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        frames = Drive(run, openai_chat_encoding.ChatStream(run.submission, run.model, options)).frames()
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in frames:
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()  # streaming has begun
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return run

    completed = state.client.engine.stats.completed
    try:
        run = asyncio.run(main())
        assert ("chatcmpl-" in aborted[0][0]) and not run.reservation.held and state.slots.in_use == 0
        deadline = time.monotonic() + 30
        while state.client.engine.stats.active and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread applies the abort at its next step
        assert state.client.engine.stats.active == 0 and state.client.engine.stats.completed == completed
    finally:
        state.client.shutdown()
