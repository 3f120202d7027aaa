"""The Litestar application: routes, auth, body decoding, admission and error mapping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.handlers import HTTPRouteHandler
from litestar.response import Stream

from helios.server import anthropic_routes, openai_routes, responses_routes
from helios.server.discovery_routes import api_show, api_tags
from helios.server.errors import anthropic_error, openai_error
from helios.server.metrics import CONTENT_TYPE, choose_format, json_snapshot, prometheus_text
from helios.server.responses import HttpError, error_response, json_response, translate
from helios.server.route_io import (
    ClientDisconnected,
    authorize,
    gone,
    json_object,
    refusal,
    state_of,
    unless_disconnected,
)
from helios.server.scoring_routes import decisions_route, systemone_route
from helios.server.state import ServerState
from helios.server.worker_routes import WORKER_ROUTES

# A protocol's route function: (state, body) or, for Messages, (state, body, headers) -> its answer.
ProtocolHandler = Callable[..., Awaitable[Response | Stream]]
RouteRunner = Callable[[Request, ProtocolHandler], Awaitable[Response | Stream]]


# ---------------------------------------------------------------------------- routes
@get("/health", sync_to_thread=False)
def health(request: Request) -> Response:
    client = state_of(request).client
    if not client.healthy:
        return json_response(openai_error(503, client.failure or "the model runtime is not running"), 503)
    if client.refusal is not None:  # draining after SIGTERM: a router stops sending here
        return json_response(openai_error(503, client.refusal), 503)
    return json_response({"status": "ok"})


@get("/metrics", sync_to_thread=False)
def metrics(request: Request) -> Response:
    state = state_of(request)
    try:
        chosen = choose_format(request.query_params.get("format"), request.headers.get("accept"))
    except ValueError as exc:
        return error_response(HttpError(400, str(exc), param="format"))
    scrape = state.scrape()
    if chosen == "json":
        return json_response(json_snapshot(scrape.values, scrape.first_response, scrape.histograms))
    text = prometheus_text(scrape.values, scrape.first_response, scrape.histograms)
    # The whole header given: for a text/* media type Litestar would append a second charset.
    return Response(content=text, media_type="text/plain", headers={"content-type": CONTENT_TYPE})


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    return json_response({"object": "list", "data": [state_of(request).card]})


@get("/v1/models/{name:path}", sync_to_thread=False)
def get_model(request: Request, name: str) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    state = state_of(request)
    name = name.lstrip("/")
    if not state.model.matches(name):
        return error_response(
            HttpError(
                404,
                f"model {name!r} does not exist (this server serves {state.model.public_id!r})",
                param="model",
                code="model_not_found",
                type="invalid_request_error",
            )
        )
    return json_response(state.card)


async def _generation(request: Request, handler: ProtocolHandler) -> Response | Stream:
    try:
        authorize(request)
        body = await json_object(request)
        return await unless_disconnected(request, handler(state_of(request), body))
    except ClientDisconnected:
        return gone()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a protocol error
        return error_response(translate(exc))


async def _anthropic(request: Request, handler: ProtocolHandler) -> Response | Stream:
    """Messages routes: x-api-key or bearer auth, and the Messages error format."""
    try:
        authorize(request, anthropic=True)
        body = await json_object(request)
        return await unless_disconnected(request, handler(state_of(request), body, dict(request.headers)))
    except ClientDisconnected:
        return gone()
    except Exception as exc:  # noqa: BLE001
        error = translate(exc)
        return json_response(anthropic_error(error.status, error.message), error.status, error.headers)


def _post(path: str, run: RouteRunner, handler: ProtocolHandler) -> HTTPRouteHandler:
    """The POST route at `path`: `run` does its auth, body and error format around `handler`."""

    async def route(request: Request) -> Response | Stream:
        return await run(request, handler)

    return post(path, status_code=200)(route)


# POST generation routes: path, the route runner (auth, body and error format), the protocol's handler.
GENERATION_ROUTES = (
    _post("/v1/chat/completions", _generation, openai_routes.chat),
    _post("/v1/completions", _generation, openai_routes.completions),
    _post("/v1/responses", _generation, responses_routes.responses),
    _post("/v1/messages", _anthropic, anthropic_routes.messages),
    _post("/v1/messages/count_tokens", _anthropic, anthropic_routes.count_tokens),
)


def _unrouted(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods, and anything that escaped a handler, in the protocol's error shape."""
    if isinstance(exc, NotFoundException):
        status, message = 404, f"no route {request.url.path!r}: see GET /v1/models and the documented routes"
    elif isinstance(exc, MethodNotAllowedException):
        status, message = 405, f"{request.method} is not allowed on {request.url.path!r}"
    elif isinstance(exc, HTTPException):
        status, message = exc.status_code, str(exc.detail)
    else:
        error = translate(exc)  # logs an unexpected failure, once
        status, message = error.status, error.message
    headers = dict(getattr(exc, "headers", None) or {})
    if request.url.path.startswith("/v1/messages"):
        return json_response(anthropic_error(status, message), status, headers)
    return json_response(openai_error(status, message), status, headers)


def create_app(state: ServerState) -> Litestar:
    app = Litestar(
        route_handlers=[
            health,
            metrics,
            list_models,
            get_model,
            *GENERATION_ROUTES,
            api_tags,
            api_show,
            systemone_route,
            decisions_route,
            *WORKER_ROUTES,
        ],
        state=State({"helios": state}),
        request_max_body_size=None,  # bounded by read_body, encoded and decoded
        on_shutdown=[lambda: state.client.shutdown(), lambda: state.frontend.grammars.probe.close()],
        exception_handlers={
            NotFoundException: _unrouted,
            MethodNotAllowedException: _unrouted,
            HTTPException: _unrouted,
            Exception: _unrouted,
        },
        debug=False,
    )
    return app
