"""Anthropic Messages and count_tokens handlers."""

from __future__ import annotations

from functools import partial
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.protocols import anthropic_encoding
from helios.protocols import anthropic_messages as am
from helios.server.driver import respond
from helios.server.generation import start
from helios.server.responses import json_response
from helios.server.state import ServerState


async def messages(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response | Stream:
    request, _ = await state.in_pool(partial(am.decode, body, headers_version=headers.get("anthropic-version")))
    run = await start(state, request, "msg")
    return await respond(run, anthropic_encoding.encoder(run.submission, run.model))


async def count_tokens(state: ServerState, body: dict[str, Any], headers: dict[str, str]) -> Response:
    conversation, output = await state.in_pool(am.count_tokens_decode, body, headers.get("anthropic-version"))
    prompt = await state.in_pool(state.frontend.prompt, conversation, output)
    return json_response({"input_tokens": len(prompt.token_ids)})
