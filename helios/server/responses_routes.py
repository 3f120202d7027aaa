"""OpenAI Responses handler (stateless): buffered response objects or named SSE events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.frontend.events import Accumulator, FinishEvent
from helios.frontend.generate import Generation, new_request_id, usage_of
from helios.frontend.inference import Termination
from helios.protocols import openai_responses as rs
from helios.server.openai_routes import SSE_HEADERS, _admit, _collect, _failure, _prepare, _record_first, _with_keepalive
from helios.server.responses import HttpError, json_response, translate
from helios.server.state import ServerState


async def responses(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = rs.decode(body)
    prompts, limits = await _prepare(state, request, [request.input])
    reservation = _admit(state, 1)
    response_id = new_request_id("resp")
    created = int(time.time())
    admitted = time.monotonic()
    try:
        generations = state.runner.submit(request, prompts, response_id, limits)
    except BaseException:
        reservation.release()
        raise
    ids = {"x-request-id": response_id}
    if request.stream:
        stream = _stream(state, generations, response_id, created, options, reservation, admitted)
        return Stream(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **ids})
    try:
        items = await _collect(state, generations, response_id)
    finally:
        reservation.release()
    problem = _failure(items)
    if problem is not None:
        raise HttpError(500, problem, headers=ids)
    _record_first(state, admitted)
    acc = Accumulator()
    for _, _, events in items.get(0, []):
        for event in events:
            acc.push(event)
    try:
        body_out = rs.response_json(response_id, created, acc, usage_of(generations), options, rs.status_of(acc.finish))
    except rs.OutputValidationError as exc:
        raise HttpError(500, str(exc), headers=ids) from None
    return json_response(body_out, headers=ids)


async def _stream(state: ServerState, generations: list[Generation], response_id: str, created: int, options,
                  reservation, admitted: float) -> AsyncIterator[bytes]:  # fmt: skip
    encoder = rs.ResponsesStream(response_id, created, options)
    acc = Accumulator()
    for event in encoder.start():
        yield rs.sse(event)
    finish: FinishEvent | None = None
    first = True
    try:
        async for item in _with_keepalive(state.runner.merged(generations, response_id)):
            if item is None:
                yield b": keepalive\n\n"
                continue
            _, _, events = item
            if first:
                first = False
                _record_first(state, admitted)
            for event in events:
                acc.push(event)
                if isinstance(event, FinishEvent):
                    finish = event
            if finish is not None and finish.termination is Termination.ERROR:
                for event in encoder.error(finish.error or "generation failed", usage_of(generations)):
                    yield rs.sse(event)
                return
            for event in encoder.push(events):
                yield rs.sse(event)
        for event in encoder.finish(finish or FinishEvent(Termination.EOS), acc, usage_of(generations)):
            yield rs.sse(event)
    except rs.OutputValidationError as exc:
        for event in encoder.error(str(exc), usage_of(generations)):
            yield rs.sse(event)
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        for event in encoder.error(translate(exc).message):
            yield rs.sse(event)
    finally:
        reservation.release()
