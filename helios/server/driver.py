"""The one loop that streams or buffers every generation route.

A route hands its `Run` and its protocol's encoder to `respond`. One pump task reads the
run's choice updates from the engine; the loop gives each to the encoder (a keepalive
after KEEPALIVE_SECONDS without one), ends with the encoder's finish, or with its error at
the first failed choice or exception. The run ends exactly once, however the loop ends: its
admission reservation goes back and its outcome is counted (completed once the encoder's finish
produced the closing frames, failed with an error; neither when the client left). Cancelling the
handler (a client disconnect) cancels the pump, which closes the engine event iterators and so
aborts the engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from helios.frontend.generate import ChoiceUpdate
from helios.frontend.inference import InferenceRequest
from helios.protocols.encoding import Encoder
from helios.server.outcomes import Outcome
from helios.server.responses import JSON, translate

KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_END = object()


class Drivable(Protocol):
    """What the driver needs of a run (helios.server.generation.Run)."""

    @property
    def request(self) -> InferenceRequest: ...

    @property
    def headers(self) -> dict[str, str]: ...

    def updates(self) -> AsyncIterator[ChoiceUpdate]: ...

    def first_output(self) -> None: ...

    def abort(self) -> None: ...

    def end(self, outcome: Outcome | None) -> None: ...


async def respond(run: Drivable, encoder: Encoder) -> Response | Stream:
    """An SSE stream (stream: true) or the buffered body, with the run's x-request-id."""
    drive = Drive(run, encoder)
    if run.request.stream:
        frames = drive.frames()

        async def close() -> None:
            # A disconnect during a send leaves the frames suspended at a yield: close them now
            # (aborting the engine request) rather than whenever the generator is collected.
            await frames.aclose()

        return Stream(
            frames,
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **run.headers},
            background=BackgroundTask(close),
        )
    body = b"".join([frame async for frame in drive.frames()])
    return Response(content=body, status_code=drive.status, media_type=JSON, headers=run.headers)


class Drive:
    """One pass of the loop; `status` is the HTTP status a buffered body goes out with."""

    def __init__(self, run: Drivable, encoder: Encoder) -> None:
        self.run = run
        self.encoder = encoder
        self.status = 200
        self.outcome: Outcome | None = None  # decided by the loop; None while running or when the client left
        self._offered = False  # the first answer went out (first_output recorded)

    async def frames(self) -> AsyncIterator[bytes]:
        run, encoder = self.run, self.encoder
        streaming = run.request.stream
        try:
            for frame in encoder.start():
                yield frame
            async with aclosing(_with_keepalive(run.updates())) as updates:
                async for update in updates:
                    if update is None:
                        for frame in encoder.keepalive():
                            yield frame
                        continue
                    if update.error is not None:
                        for frame in self._error(500, update.error):
                            yield frame
                        return
                    if streaming and update.offers_output and not self._offered:
                        self._offered = True
                        run.first_output()
                    for frame in encoder.push(update):
                        yield frame
            closing = encoder.finish()
            self.outcome = Outcome.COMPLETED
            if not streaming:
                run.first_output()  # a buffered answer is offered whole, once it encoded
            for frame in closing:
                yield frame
        except Exception as exc:  # noqa: BLE001 - after the headers, failures are terminal protocol errors
            error = translate(exc)
            for frame in self._error(error.status, error.message):
                yield frame
        finally:
            run.abort()  # no-op when every choice finished; covers children whose iterator never started
            run.end(self.outcome)

    def _error(self, status: int, message: str) -> list[bytes]:
        self.status, self.outcome = status, Outcome.FAILED
        return self.encoder.error(status, message)


async def _with_keepalive(updates: AsyncIterator[ChoiceUpdate]) -> AsyncIterator[ChoiceUpdate | None]:
    """The updates, or None after KEEPALIVE_SECONDS without one.

    A pump task reads the updates, so a timeout never interrupts the engine iterators; when
    this generator ends early or is cancelled, it cancels the pump, which closes them. One
    timer per stream, re-armed only when it fires, notices the silence: a timeout context
    around every update cost a timer handle per token.
    """
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    last = loop.time()

    async def pump() -> None:
        nonlocal last
        try:
            async with aclosing(updates) as source:
                async for update in source:
                    last = loop.time()
                    queue.put_nowait(update)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - raised again by the consumer
            queue.put_nowait(exc)

    def check() -> None:
        nonlocal last, timer
        now = loop.time()
        if now - last >= KEEPALIVE_SECONDS:
            last = now  # also when updates wait in the queue: the consumer is busy, not silent
            if queue.empty():
                queue.put_nowait(None)
        timer = loop.call_at(last + KEEPALIVE_SECONDS, check)

    timer = loop.call_at(last + KEEPALIVE_SECONDS, check)
    task = asyncio.create_task(pump())
    try:
        while True:
            item = await queue.get()
            if item is None:
                yield None
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        timer.cancel()
        task.cancel()
        # Wait for the iterators to close, so the engine has the abort before this returns;
        # a second cancellation of this task interrupts only the wait, not the pump's.
        await asyncio.wait({task})
