"""Ollama discovery routes: GET /api/tags and POST /api/show (spec: Ollama model discovery).

Errors are {"error": message} except authentication, which keeps the OpenAI format.
"""

from __future__ import annotations

from litestar import Request, Response, get, post

from helios.protocols import ollama
from helios.server.responses import HttpError, json_response
from helios.server.route_io import read_json, refusal, state_of


def _discovery(request: Request) -> ollama.Discovery:
    state = state_of(request)
    card = state.card
    return ollama.discovery(state.model, state.core.manifest, card["max_model_len"], card["flare"]["precision"])


def _failure(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


@get("/api/tags", sync_to_thread=False)
def api_tags(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    return json_response(ollama.tags(_discovery(request)))


@post("/api/show", status_code=200)
async def api_show(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    try:
        name = ollama.decode_show(await read_json(request, compressed=False))
    except HttpError as exc:
        return _failure(exc.status, exc.message)
    except ollama.DiscoveryError as exc:
        return _failure(exc.status, exc.message)
    state = state_of(request)
    if not state.model.matches(name):
        return _failure(404, f"model {name!r} not found (this server serves {state.model.public_id!r})")
    return json_response(ollama.show(_discovery(request)))
