"""Chat Completions and Completions handlers: decode (on the frontend pool), start, drive."""

from __future__ import annotations

from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.protocols import openai_chat, openai_chat_encoding, openai_completions, openai_completions_encoding
from helios.server.driver import respond
from helios.server.generation import start
from helios.server.state import ServerState


async def chat(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = await state.in_pool(openai_chat.decode, body)
    run = await start(state, request, "chatcmpl")
    return await respond(run, openai_chat_encoding.encoder(run.submission, run.model, options, state.runner.token_text))


async def completions(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    request, options = await state.in_pool(openai_completions.decode, body)
    run = await start(state, request, "cmpl")
    runner = state.runner
    token_text = _token_id_text if request.logprobs.as_token_ids else runner.token_text
    encoder = openai_completions_encoding.encoder(
        run.submission, run.model, options, token_text, runner.token_text, state.config.prefill_chunk_size
    )
    return await respond(run, encoder)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
