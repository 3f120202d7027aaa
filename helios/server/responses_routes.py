"""OpenAI Responses handler (stateless): buffered response objects or named SSE events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.frontend.events import Accumulator, FinishEvent
from helios.frontend.inference import Termination
from helios.protocols import openai_responses as rs
from helios.server.generation import Run, accumulate, finish_of, start
from helios.server.responses import HttpError, json_response, translate
from helios.server.state import ServerState


async def responses(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = rs.decode(body)
    run = await start(state, request, [request.input], "resp")
    created = int(time.time())
    if request.stream:
        return run.stream(_events(run, created, options))
    acc = accumulate((await run.collect()).get(0, []))
    try:
        body_out = rs.response_json(run.request_id, created, acc, run.usage(), options, rs.status_of(acc.finish))
    except rs.OutputValidationError as exc:  # e.g. a custom tool call outside its grammar
        raise HttpError(500, str(exc), headers=run.headers) from None
    return json_response(body_out, headers=run.headers)


async def _events(run: Run, created: int, options) -> AsyncIterator[bytes]:
    encoder = rs.ResponsesStream(run.request_id, created, options)
    acc = Accumulator()
    finish: FinishEvent | None = None
    for event in encoder.start():
        yield rs.sse(event)
    try:
        async for item in run.items():
            if item is None:
                yield b": keepalive\n\n"
                continue
            _, _, events = item
            run.first_output()
            for event in events:
                acc.push(event)
            finish = finish_of(events) or finish
            if finish is not None and finish.termination is Termination.ERROR:
                for event in encoder.error(finish.error or "generation failed", run.usage()):
                    yield rs.sse(event)
                return
            for event in encoder.push(events):
                yield rs.sse(event)
        for event in encoder.finish(finish or FinishEvent(Termination.EOS), acc, run.usage()):
            yield rs.sse(event)
    except rs.OutputValidationError as exc:
        for event in encoder.error(str(exc), run.usage()):
            yield rs.sse(event)
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        for event in encoder.error(translate(exc).message):
            yield rs.sse(event)
