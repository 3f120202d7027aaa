"""The routes a cache-aware router calls on its workers (docs/scaling.md): vllm-router and SGLang's
model gateway (sglang-router) put helios replicas behind one address with little from each.

  GET  /get_server_info, /server_info  serving limits and the flare card (SGLang's names where it has them)
  GET  /get_model_info, /model_info    the loaded model (sglang-router reads its model id from here)
  GET  /health_generate                one generated token through the engine: a wedged engine fails it
  POST /flush_cache                    drop every cached prefix; refused (409) while requests are open
  GET  /get_load                       open requests ({"load": n}, vllm-router's form)

All but /get_load take the serving key as /v1/models does. /get_load, like /health and /metrics,
reports aggregate counts only and answers without the key: vllm-router asks for it without one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from litestar import Request, Response, get, post

import helios
from helios.engine import GREEDY, EngineRequest, EngineUnavailable, FlushRefused, QueueFull
from helios.server.errors import openai_error
from helios.server.responses import json_response
from helios.server.route_io import refusal, state_of
from helios.server.state import ServerState

HEALTH_GENERATE_SECONDS = 30.0  # a probe token not back by then: the engine is wedged (503)
FLUSH_SECONDS = 60.0  # the engine thread runs the flush between steps; a step never takes this long


def model_info(state: ServerState) -> dict[str, Any]:
    """GET /get_model_info: SGLang's model fields (served_model_name is the /v1/models id), plus the
    card's max_model_len and flare object."""
    card = state.card
    flare = card["flare"]
    return {
        "model_path": state.model.checkpoint_id,
        "tokenizer_path": state.model.checkpoint_id,
        "served_model_name": state.model.public_id,
        "aliases": list(state.model.aliases),
        "recipe": state.core.manifest.recipe.name,
        "is_generation": True,
        "has_image_understanding": "image" in flare["input_modalities"],
        "has_audio_understanding": False,
        "max_context_length": card["max_model_len"],
        "max_model_len": card["max_model_len"],
        "vocab_size": flare["vocab_size"],
        "preferred_sampling_params": flare["sampling_defaults"],
        "flare": flare,
    }


def server_info(state: ServerState) -> dict[str, Any]:
    """GET /get_server_info: the serving limits under SGLang's names (context_length,
    max_running_requests, max_total_num_tokens, page_size, chunked_prefill_size, dp_size, tp_size),
    what vLLM calls them (max_model_len), and the flare card."""
    config, card = state.config, state.card
    engine = state.client.metrics()
    return {
        "version": helios.__version__,
        "model_path": state.model.checkpoint_id,
        "served_model_name": state.model.public_id,
        "context_length": card["max_model_len"],
        "max_model_len": card["max_model_len"],
        "max_running_requests": config.max_concurrency,
        "max_queued_requests": config.queue_size,
        "max_total_num_tokens": engine.total_pages * engine.page_tokens,
        "page_size": engine.page_tokens,
        "chunked_prefill_size": config.prefill_chunk_size,
        "enable_prefix_caching": config.prefix_cache,
        "host_prefix_cache": config.host_cache,
        "tp_size": config.parallel.tensor,
        "dp_size": 1,  # one replica is one data-parallel rank; a router spreads over replicas
        "device": engine.device,
        "api_key_required": bool(config.api_key),
        "flare": card["flare"],
    }


def load(state: ServerState) -> dict[str, int]:
    """GET /get_load: requests submitted to the engine and not finished (running and waiting)."""
    engine = state.client.metrics()
    return {"load": state.client.num_open, "num_reqs": engine.active, "num_waiting_reqs": engine.pending}


async def probe(state: ServerState) -> str | None:
    """One generated token through the engine: None when it came back, else why not."""
    # The probe: one greedy token after token 0 (every vocabulary has it), outside the prefix cache.
    request = EngineRequest(f"health-{uuid.uuid4().hex}", (0,), (GREEDY,), 1, use_prefix_cache=False)
    try:
        events = state.client.submit(request)
    except (EngineUnavailable, QueueFull) as exc:
        return str(exc)
    generated = 0

    async def run() -> None:
        nonlocal generated
        async for event in events:
            generated += len(event.token_ids)
            if event.error is not None:
                raise EngineUnavailable(event.error)

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_SECONDS)
    except TimeoutError:
        return f"the engine generated no token within {HEALTH_GENERATE_SECONDS:.0f} s"
    except EngineUnavailable as exc:
        return str(exc)
    return None if generated else "the engine finished the probe without a token"


@get(["/get_model_info", "/model_info"], sync_to_thread=False)
def get_model_info(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    return json_response(model_info(state_of(request)))


@get(["/get_server_info", "/server_info"], sync_to_thread=False)
def get_server_info(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    return json_response(server_info(state_of(request)))


@get("/get_load", sync_to_thread=False)
def get_load(request: Request) -> Response:
    return json_response(load(state_of(request)))


@get("/health_generate")
async def health_generate(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    state = state_of(request)
    if state.client.refusal is not None:  # draining: the router must stop sending here
        return json_response(openai_error(503, state.client.refusal), 503)
    problem = await probe(state)
    if problem is not None:
        return json_response(openai_error(503, problem), 503)
    return json_response({"status": "ok"})


@post("/flush_cache", status_code=200)
async def flush_cache(request: Request) -> Response:
    if (refused := refusal(request)) is not None:
        return refused
    future = state_of(request).client.flush_prefix_cache()
    try:
        flushed = await asyncio.wait_for(asyncio.wrap_future(future), FLUSH_SECONDS)
    except FlushRefused as exc:
        return json_response(openai_error(409, str(exc)), 409)
    except (EngineUnavailable, TimeoutError) as exc:
        return json_response(openai_error(503, str(exc) or "the engine did not run the flush"), 503)
    return json_response(
        {
            "status": "ok",
            "message": "the prefix cache was flushed",
            "dropped": {
                "pages": flushed.pages,
                "window_pages": flushed.window_pages,
                "snapshots": flushed.snapshots,
                "host_records": flushed.host_records,
            },
        }
    )


WORKER_ROUTES = (get_model_info, get_server_info, get_load, health_generate, flush_cache)
