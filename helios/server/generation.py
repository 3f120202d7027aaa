"""What every generation route does: prepare, admit, submit, then collect or stream.

Routes decode their protocol, call `start`, and either `collect` (buffered) or return
`stream` over their own event encoder. Admission slots are released exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from litestar.response import Stream

from helios.frontend.events import Accumulator, FinishEvent
from helios.frontend.generate import Generation, Item, new_request_id, usage_of
from helios.frontend.inference import InferenceRequest, Termination
from helios.frontend.request import PreparedPrompt
from helios.server.admission import Reservation
from helios.server.responses import HttpError
from helios.server.state import ServerState

KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def with_keepalive(items: AsyncIterator, interval: float = KEEPALIVE_SECONDS) -> AsyncIterator:
    """Yield items, or None after `interval` seconds without one (time for an SSE comment)."""
    iterator = items.__aiter__()
    pending = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(iterator.__anext__())
    finally:
        pending.cancel()


def finish_of(events: list) -> FinishEvent | None:
    return next((e for e in events if isinstance(e, FinishEvent)), None)


def accumulate(items: list[Item]) -> Accumulator:
    acc = Accumulator()
    for _, _, events in items:
        for event in events:
            acc.push(event)
    return acc


@dataclass(eq=False)
class Run:
    """One admitted, submitted request."""

    state: ServerState
    request: InferenceRequest
    prompts: list[PreparedPrompt]
    generations: list[Generation]
    request_id: str
    reservation: Reservation
    admitted: float = field(default_factory=time.monotonic)
    _first_seen: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.request_id}

    @property
    def model(self) -> str:
        return self.state.model.public_id

    def usage(self):
        return usage_of(self.generations)

    def first_output(self) -> None:
        """Record time-to-first-answer once (metrics' first_response window)."""
        if not self._first_seen:
            self._first_seen = True
            self.state.first_response.record(time.monotonic() - self.admitted)

    def items(self) -> AsyncIterator[Item | None]:
        """Every choice's items in arrival order; None marks a keepalive opportunity."""
        return with_keepalive(self.state.runner.merged(self.generations, self.request_id))

    async def collect(self) -> dict[int, list[Item]]:
        """All items by choice index; a failed choice becomes HTTP 500."""
        items: dict[int, list[Item]] = {}
        try:
            async for item in self.state.runner.merged(self.generations, self.request_id):
                items.setdefault(item[0], []).append(item)
        finally:
            self.reservation.release()
        for choice_items in items.values():
            for _, _, events in choice_items:
                finish = finish_of(events)
                if finish is not None and finish.termination is Termination.ERROR:
                    raise HttpError(500, finish.error or "generation failed", headers=self.headers)
        self.first_output()
        return items

    def stream(self, body: AsyncIterator[bytes]) -> Stream:
        async def guarded() -> AsyncIterator[bytes]:
            try:
                async for chunk in body:
                    yield chunk
            finally:
                self.reservation.release()

        return Stream(guarded(), media_type="text/event-stream", headers={**SSE_HEADERS, **self.headers})


def admit(state: ServerState, slots: int) -> Reservation:
    """One HTTP admission slot per choice, or 429."""
    reservation = state.slots.reserve(slots)
    if reservation is None:
        raise HttpError(429, "all HTTP admission slots are in use; retry later")
    return reservation


async def start(state: ServerState, request: InferenceRequest, sources: list, prefix: str) -> Run:
    """Validate, tokenize, take one admission slot per choice (429 when none), submit."""
    frontend = state.frontend
    frontend.check_options(request)
    if request.output is not None:
        await state.in_pool(frontend.compile_output, request.output)  # bounded; cached for engine_request
    prompts = [await state.in_pool(frontend.prompt, source, request.output) for source in sources]
    limits = [frontend.max_tokens(request, len(p.token_ids)) if request.max_tokens != 0 else 0 for p in prompts]
    reservation = admit(state, request.n * len(prompts))
    request_id = new_request_id(prefix)
    try:
        generations = state.runner.submit(request, prompts, request_id, limits)
    except BaseException:
        reservation.release()
        raise
    return Run(state, request, prompts, generations, request_id, reservation)
