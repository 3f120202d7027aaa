"""Anthropic Messages and count_tokens handlers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.frontend.events import Accumulator, FinishEvent
from helios.frontend.generate import Generation, new_request_id, usage_of
from helios.frontend.inference import Termination
from helios.protocols import anthropic_messages as am
from helios.server.openai_routes import SSE_HEADERS, _admit, _collect, _failure, _prepare, _record_first, _with_keepalive
from helios.server.responses import HttpError, json_response, translate
from helios.server.state import ServerState


async def messages(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response | Stream:
    request, options = am.decode(body, headers_version=headers.get("anthropic-version"))
    prompts, limits = await _prepare(state, request, [request.input])
    reservation = _admit(state, 1)
    message_id = new_request_id("msg")
    admitted = time.monotonic()
    try:
        generations = state.runner.submit(request, prompts, message_id, limits)
    except BaseException:
        reservation.release()
        raise
    model = state.model.public_id
    ids = {"x-request-id": message_id}
    if request.stream:
        stream = _stream(state, generations, message_id, model, reservation, admitted)
        return Stream(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **ids})
    try:
        items = await _collect(state, generations, message_id)
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
    return json_response(am.message_json(message_id, model, acc, usage_of(generations)), headers=ids)


async def _stream(state: ServerState, generations: list[Generation], message_id: str, model: str, reservation,
                  admitted: float) -> AsyncIterator[bytes]:  # fmt: skip
    encoder = am.MessagesStream(message_id, model, len(generations[0].prompt.token_ids))
    started = False
    finish: FinishEvent | None = None
    try:
        async for item in _with_keepalive(state.runner.merged(generations, message_id)):
            if item is None:
                yield b"event: ping\ndata: {\"type\": \"ping\"}\n\n"
                continue
            _, _, events = item
            if not started:
                started = True
                _record_first(state, admitted)
                for name, data in encoder.start():
                    yield am.sse(name, data)
            for event in events:
                if isinstance(event, FinishEvent):
                    finish = event
            if finish is not None and finish.termination is Termination.ERROR:
                for name, data in encoder.error(500, finish.error or "generation failed"):
                    yield am.sse(name, data)
                return
            for name, data in encoder.push(events):
                yield am.sse(name, data)
        for name, data in encoder.finish(finish or FinishEvent(Termination.EOS), usage_of(generations)):
            yield am.sse(name, data)
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        error = translate(exc)
        for name, data in encoder.error(error.status, error.message):
            yield am.sse(name, data)
    finally:
        reservation.release()


async def count_tokens(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response:
    conversation = am.count_tokens_decode(body, headers.get("anthropic-version"))
    prompt = await state.in_pool(state.frontend.prompt, conversation)
    return json_response({"input_tokens": len(prompt.token_ids)})
