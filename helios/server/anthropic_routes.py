"""Anthropic Messages and count_tokens handlers."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.frontend.parsers.reasoning import reasoning_delimiters
from helios.protocols import anthropic_encoding
from helios.protocols import anthropic_messages as am
from helios.server.driver import respond
from helios.server.generation import start
from helios.server.responses import json_response
from helios.server.state import ServerState


async def messages(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response | Stream:
    request, options = await state.in_pool(partial(am.decode, body, headers_version=headers.get("anthropic-version")))
    if request.thinking_token_budget is not None and not options.explicit_budget and not _can_cap(state):
        request = replace(request, thinking_token_budget=None)  # thinking.budget_tokens is then only an effort hint
    run = await start(state, request, [request.input], "msg")
    return await respond(run, anthropic_encoding.encoder(run.submission, run.model))


def _can_cap(state: ServerState) -> bool:
    """Whether the model's reasoning syntax allows a hard budget (a single-token close delimiter)."""
    syntax = state.frontend.manifest.recipe.reasoning_syntax
    return bool(syntax) and reasoning_delimiters(syntax, state.frontend.tokenizer) is not None


async def count_tokens(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response:
    conversation, output = await state.in_pool(am.count_tokens_decode, body, headers.get("anthropic-version"))
    prompt = await state.in_pool(state.frontend.prompt, conversation, output)
    return json_response({"input_tokens": len(prompt.token_ids)})
