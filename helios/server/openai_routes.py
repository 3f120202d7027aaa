"""Chat Completions and Completions handlers: prepare, admit, submit, then buffer or stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Response
from litestar.response import Stream

from helios.frontend.events import FinishEvent
from helios.frontend.generate import Generation, Item, new_request_id, usage_of
from helios.frontend.inference import InferenceRequest, Termination
from helios.frontend.output import text_offsets
from helios.frontend.request import PreparedPrompt
from helios.protocols import openai_chat, openai_completions
from helios.protocols.openai_common import now, prompt_logprobs_wire, usage_object
from helios.server.admission import Reservation
from helios.server.errors import openai_error
from helios.server.responses import HttpError, json_response, translate
from helios.server.state import ServerState

KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _with_keepalive(items: AsyncIterator, interval: float = KEEPALIVE_SECONDS) -> AsyncIterator:
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


async def _prepare(state: ServerState, request: InferenceRequest, sources: list) -> tuple[list[PreparedPrompt], list[int]]:
    frontend = state.frontend
    frontend.check_options(request)
    prompts = [await state.in_pool(frontend.prompt, source) for source in sources]
    limits = [frontend.max_tokens(request, len(p.token_ids)) if request.max_tokens != 0 else 0 for p in prompts]
    return prompts, limits


def _admit(state: ServerState, slots: int) -> Reservation:
    reservation = state.slots.reserve(slots)
    if reservation is None:
        raise HttpError(429, "all HTTP admission slots are in use; retry later")
    return reservation


def _headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id}


async def _collect(state: ServerState, generations: list[Generation], request_id: str) -> dict[int, list[Item]]:
    items: dict[int, list[Item]] = {}
    async for item in state.runner.merged(generations, request_id):
        items.setdefault(item[0], []).append(item)
    return items


def _failure(items: dict[int, list[Item]]) -> str | None:
    for choice_items in items.values():
        for _, _, events in choice_items:
            for event in events:
                if isinstance(event, FinishEvent) and event.termination is Termination.ERROR:
                    return event.error or "generation failed"
    return None


def _finish_of(events: list) -> FinishEvent | None:
    return next((e for e in events if isinstance(e, FinishEvent)), None)


# ---------------------------------------------------------------------------- chat
async def chat(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = openai_chat.decode(body)
    prompts, limits = await _prepare(state, request, [request.input])
    reservation = _admit(state, request.n)
    request_id = new_request_id("chatcmpl")
    admitted = time.monotonic()
    try:
        generations = state.runner.submit(request, prompts, request_id, limits)
    except BaseException:
        reservation.release()
        raise
    model = state.model.public_id
    if request.stream:
        stream = _chat_stream(state, generations, request_id, model, options, reservation, admitted)
        return Stream(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **_headers(request_id)})
    try:
        deltas = await _collect(state, generations, request_id)
    finally:
        reservation.release()
    problem = _failure(deltas)
    if problem is not None:
        raise HttpError(500, problem, headers=_headers(request_id))
    states = {}
    for index, choice_items in deltas.items():
        choice = openai_chat.ChoiceState()
        for _, delta, events in choice_items:
            openai_chat.apply(choice, delta, events, options)
        states[index] = choice
    _record_first(state, admitted)
    generation = generations[0]
    prompt_logprobs = prompt_logprobs_wire(generation.prompt_logprobs, _decoder(state))
    body_out = openai_chat.response(request_id, model, states, usage_of(generations), options, prompt_logprobs,
                                    generation.prompt.token_ids)  # fmt: skip
    return json_response(body_out, headers=_headers(request_id))


async def _chat_stream(state: ServerState, generations: list[Generation], request_id: str, model: str,
                       options: openai_chat.ChatOptions, reservation, admitted: float) -> AsyncIterator[bytes]:  # fmt: skip
    created = now()
    started: set[int] = set()
    tool_counter: dict[int, int] = {}  # tool calls streamed so far, per choice
    try:
        async for item in _with_keepalive(state.runner.merged(generations, request_id)):
            if item is None:
                yield b": keepalive\n\n"
                continue
            index, delta, events = item
            finish = _finish_of(events)
            if finish is not None and finish.termination is Termination.ERROR:
                yield _sse(openai_error(500, finish.error or "generation failed"))
                return
            if index not in started:  # the role delta only once the first token exists
                started.add(index)
                if len(started) == 1:
                    _record_first(state, admitted)
                yield _sse(openai_chat.chunk(request_id, model, created, index, {"role": "assistant", "content": ""}))
            usage = usage_object(usage_of(generations), reasoning=True) if options.continuous_usage else None
            for body in openai_chat.stream_chunks(request_id, model, created, index, delta, events, options,
                                                  tool_counter, usage):  # fmt: skip
                yield _sse(body)
        if options.include_usage:
            yield _sse(openai_chat.usage_chunk(request_id, model, created, usage_of(generations)))
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        error = translate(exc)
        yield _sse(openai_error(error.status, error.message, param=error.param, code=error.code))
    finally:
        reservation.release()


def _record_first(state: ServerState, admitted: float) -> None:
    state.first_response.record(time.monotonic() - admitted)


def _decoder(state: ServerState):
    tokenizer = state.frontend.tokenizer
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


# ---------------------------------------------------------------------------- completions
async def completions(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, sources, options = openai_completions.decode(body)
    prompts, limits = await _prepare(state, request, sources)
    reservation = _admit(state, request.n * len(prompts))
    request_id = new_request_id("cmpl")
    admitted = time.monotonic()
    try:
        generations = state.runner.submit(request, prompts, request_id, limits)
    except BaseException:
        reservation.release()
        raise
    model = state.model.public_id
    if request.stream:
        stream = _completion_stream(state, request, generations, request_id, model, options, reservation)
        return Stream(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **_headers(request_id)})
    try:
        deltas = await _collect(state, generations, request_id)
    finally:
        reservation.release()
    problem = _failure(deltas)
    if problem is not None:
        raise HttpError(500, problem, headers=_headers(request_id))
    _record_first(state, admitted)
    decoder = _token_text(state, request.logprobs.as_token_ids)
    choices = []
    for generation in generations:
        prompt_logprobs = prompt_logprobs_wire(generation.prompt_logprobs, _decoder(state))
        for j in range(request.n):
            index = generation.first_index + j
            text, arrays = _echo_start(request, generation, options, decoder)
            finish = Termination.LENGTH if generation.events is None else None
            for _, delta, _events in deltas.get(index, []):
                if arrays is not None:
                    arrays.add_generated(delta.entries, delta.text, text_offsets(delta.entries, arrays.chars))
                text += delta.text
                finish = delta.finish or finish
            choices.append(openai_completions.choice_json(index, text, arrays, finish, prompt_logprobs))
    usage = usage_of(generations)
    if request.max_tokens == 0:
        usage.cached_tokens = 0 if request.logprobs.prompt is None else usage.cached_tokens
    return json_response(openai_completions.response(request_id, model, choices, usage), headers=_headers(request_id))


def _token_text(state: ServerState, as_ids: bool):
    tokenizer = state.frontend.tokenizer
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _echo_start(request: InferenceRequest, generation: Generation, options, decoder) -> tuple[str, Any]:
    arrays = openai_completions.Arrays() if options.logprobs is not None else None
    if not request.echo:
        return "", arrays
    prompt_text = generation.prompt.text
    if prompt_text is None:
        prompt_text = _decode_prompt(generation)
    if arrays is not None:
        openai_completions.add_prompt_entries(arrays, generation.prompt.token_ids, generation.prompt_logprobs, decoder,
                                              options.logprobs or 0)  # fmt: skip
        arrays.chars = len(prompt_text)
    return prompt_text, arrays


def _decode_prompt(generation: Generation) -> str:
    choice = generation.choices[0]
    return b"".join(choice.tokens.bytes_of(t) for t in generation.prompt.token_ids).decode("utf-8", "replace")


async def _completion_stream(state: ServerState, request: InferenceRequest, generations: list[Generation],
                             request_id: str, model: str, options, reservation) -> AsyncIterator[bytes]:  # fmt: skip
    created = now()
    decoder = _token_text(state, request.logprobs.as_token_ids)
    arrays: dict[int, Any] = {}
    try:
        for generation in generations:  # echo frames and zero-token choices come first
            for j in range(request.n):
                index = generation.first_index + j
                if request.echo and generation.events is None:
                    text, arr = _echo_start(request, generation, options, decoder)
                    yield _sse(openai_completions.chunk(request_id, model, created,
                                                        openai_completions.choice_json(index, text, arr, Termination.LENGTH)))  # fmt: skip
                elif generation.events is None:
                    yield _sse(openai_completions.chunk(request_id, model, created,
                                                        openai_completions.choice_json(index, "", None, Termination.LENGTH)))  # fmt: skip
        async for item in _with_keepalive(state.runner.merged(generations, request_id)):
            if item is None:
                yield b": keepalive\n\n"
                continue
            index, delta, _events = item
            if delta.finish is Termination.ERROR:
                yield _sse(openai_error(500, delta.error or "generation failed"))
                return
            text = ""
            if index in arrays:
                arr = arrays[index]
                start = len(arr.tokens) if arr is not None else 0
            else:  # the choice's first frame carries its echo
                if request.echo:
                    text, arr = _echo_start(request, generations[index // request.n], options, decoder)
                else:
                    arr = openai_completions.Arrays() if options.logprobs is not None else None
                arrays[index], start = arr, 0
            if arr is not None:
                arr.add_generated(delta.entries, delta.text, text_offsets(delta.entries, arr.chars))
            piece = arr.since(start) if arr is not None else None
            usage = usage_object(usage_of(generations), reasoning=False) if options.continuous_usage else None
            choice = openai_completions.choice_json(index, text + delta.text, piece, delta.finish)
            yield _sse(openai_completions.chunk(request_id, model, created, choice, usage))
        if options.include_usage:
            yield _sse(openai_completions.usage_chunk(request_id, model, created, usage_of(generations)))
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001
        error = translate(exc)
        yield _sse(openai_error(error.status, error.message, param=error.param, code=error.code))
    finally:
        reservation.release()
