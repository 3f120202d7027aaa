"""Chat Completions and Completions handlers: prepare, admit, submit, then buffer or stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Response
from litestar.response import Stream

from helios.frontend.generate import Generation
from helios.frontend.inference import InferenceRequest, Termination
from helios.frontend.output import text_offsets
from helios.protocols import openai_chat, openai_completions
from helios.protocols.openai_common import now, prompt_logprobs_wire, usage_object
from helios.server.errors import openai_error
from helios.server.generation import Run, finish_of, start
from helios.server.responses import json_response, translate
from helios.server.state import ServerState

def _sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


# ---------------------------------------------------------------------------- chat
async def chat(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = openai_chat.decode(body)
    run = await start(state, request, [request.input], "chatcmpl")
    if request.stream:
        return run.stream(_chat_stream(run, options))
    states = {}
    for index, choice_items in (await run.collect()).items():
        choice = openai_chat.ChoiceState()
        for _, delta, events in choice_items:
            openai_chat.apply(choice, delta, events, options)
        states[index] = choice
    generation = run.generations[0]
    prompt_logprobs = prompt_logprobs_wire(generation.prompt_logprobs, _decoder(state))
    body_out = openai_chat.response(run.request_id, run.model, states, run.usage(), options, prompt_logprobs,
                                    generation.prompt.token_ids)  # fmt: skip
    return json_response(body_out, headers=run.headers)


async def _chat_stream(run: Run, options: openai_chat.ChatOptions) -> AsyncIterator[bytes]:
    created, model, request_id = now(), run.model, run.request_id
    started: set[int] = set()
    tool_counter: dict[int, int] = {}  # tool calls streamed so far, per choice
    try:
        async for item in run.items():
            if item is None:
                yield b": keepalive\n\n"
                continue
            index, delta, events = item
            finish = finish_of(events)
            if finish is not None and finish.termination is Termination.ERROR:
                yield _sse(openai_error(500, finish.error or "generation failed"))
                return
            if index not in started:  # the role delta only once the first token exists
                started.add(index)
                run.first_output()
                yield _sse(openai_chat.chunk(request_id, model, created, index, {"role": "assistant", "content": ""}))
            usage = usage_object(run.usage(), reasoning=True) if options.continuous_usage else None
            for body in openai_chat.stream_chunks(request_id, model, created, index, delta, events, options,
                                                  tool_counter, usage):  # fmt: skip
                yield _sse(body)
        if options.include_usage:
            yield _sse(openai_chat.usage_chunk(request_id, model, created, run.usage()))
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        error = translate(exc)
        yield _sse(openai_error(error.status, error.message, param=error.param, code=error.code))


def _decoder(state: ServerState):
    tokenizer = state.frontend.tokenizer
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


# ---------------------------------------------------------------------------- completions
async def completions(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, sources, options = openai_completions.decode(body)
    run = await start(state, request, sources, "cmpl")
    if request.stream:
        return run.stream(_completion_stream(run, options))
    items = await run.collect()
    decoder = _token_text(state, request.logprobs.as_token_ids)
    choices = []
    for generation in run.generations:
        prompt_logprobs = prompt_logprobs_wire(generation.prompt_logprobs, _decoder(state))
        for j in range(request.n):
            index = generation.first_index + j
            text, arrays = _echo_start(request, generation, options, decoder)
            finish = Termination.LENGTH if generation.events is None else None
            for _, delta, _events in items.get(index, []):
                if arrays is not None:
                    arrays.add_generated(delta.entries, delta.text, text_offsets(delta.entries, arrays.chars))
                text += delta.text
                finish = delta.finish or finish
            choices.append(openai_completions.choice_json(index, text, arrays, finish, prompt_logprobs))
    usage = run.usage()
    if request.max_tokens == 0 and request.logprobs.prompt is None:
        usage.cached_tokens = 0  # nothing was looked up
    return json_response(openai_completions.response(run.request_id, run.model, choices, usage), headers=run.headers)


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


async def _completion_stream(run: Run, options) -> AsyncIterator[bytes]:
    state, request, generations = run.state, run.request, run.generations
    request_id, model = run.request_id, run.model
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
        async for item in run.items():
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
            usage = usage_object(run.usage(), reasoning=False) if options.continuous_usage else None
            choice = openai_completions.choice_json(index, text + delta.text, piece, delta.finish)
            yield _sse(openai_completions.chunk(request_id, model, created, choice, usage))
        if options.include_usage:
            yield _sse(openai_completions.usage_chunk(request_id, model, created, run.usage()))
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001
        error = translate(exc)
        yield _sse(openai_error(error.status, error.message, param=error.param, code=error.code))
