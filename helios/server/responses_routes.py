"""OpenAI Responses handler (stateless): buffered response objects or named SSE events."""

from __future__ import annotations

from functools import partial
from typing import Any

from litestar import Response
from litestar.response import Stream

from helios.protocols import openai_responses as rs
from helios.server.driver import respond
from helios.server.generation import start
from helios.server.state import ServerState


async def responses(state: ServerState, body: dict[str, Any]) -> Response | Stream:
    # Decoding compiles custom-tool grammars: on the bounded pool, through the shared cache.
    request, options = await state.in_pool(partial(rs.decode, body, grammars=state.frontend.grammars.tool_grammar))
    run = await start(state, request, "resp")
    return await respond(run, rs.encoder(run.submission, run.model, options))
