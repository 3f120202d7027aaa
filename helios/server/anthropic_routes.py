"""Anthropic Messages and count_tokens handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.frontend.events import FinishEvent
from helios.frontend.inference import Termination
from helios.frontend.parsers.reasoning import reasoning_delimiters
from helios.protocols import anthropic_messages as am
from helios.server.generation import Run, accumulate, finish_of, start
from helios.server.responses import json_response, translate
from helios.server.state import ServerState


async def messages(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response | Stream:
    request, options = am.decode(body, headers_version=headers.get("anthropic-version"))
    if request.thinking_token_budget is not None and not options.explicit_budget and not _can_cap(state):
        request = replace(request, thinking_token_budget=None)  # thinking.budget_tokens is then only an effort hint
    run = await start(state, request, [request.input], "msg")
    if request.stream:
        return run.stream(_events(run))
    items = await run.collect()
    acc = accumulate(items.get(0, []))
    return json_response(am.message_json(run.request_id, run.model, acc, run.usage()), headers=run.headers)


def _can_cap(state: ServerState) -> bool:
    """Whether the model's reasoning syntax allows a hard budget (a single-token close delimiter)."""
    syntax = state.frontend.manifest.recipe.reasoning_syntax
    return bool(syntax) and reasoning_delimiters(syntax, state.frontend.tokenizer) is not None


async def _events(run: Run) -> AsyncIterator[bytes]:
    encoder = am.MessagesStream(run.request_id, run.model, len(run.prompts[0].token_ids))
    started = False
    finish: FinishEvent | None = None
    try:
        async for item in run.items():
            if item is None:
                yield am.sse("ping", {"type": "ping"})
                continue
            _, _, events = item
            if not started:  # message_start waits for the first token, like the role chunk on Chat
                started = True
                run.first_output()
                for name, data in encoder.start():
                    yield am.sse(name, data)
            finish = finish_of(events) or finish
            if finish is not None and finish.termination is Termination.ERROR:
                for name, data in encoder.error(500, finish.error or "generation failed"):
                    yield am.sse(name, data)
                return
            for name, data in encoder.push(events):
                yield am.sse(name, data)
        for name, data in encoder.finish(finish or FinishEvent(Termination.EOS), run.usage()):
            yield am.sse(name, data)
    except Exception as exc:  # noqa: BLE001 - after the headers, errors are terminal events
        error = translate(exc)
        for name, data in encoder.error(error.status, error.message):
            yield am.sse(name, data)


async def count_tokens(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response:
    conversation, output = am.count_tokens_decode(body, headers.get("anthropic-version"))
    prompt = await state.in_pool(state.frontend.prompt, conversation, output)
    return json_response({"input_tokens": len(prompt.token_ids)})
