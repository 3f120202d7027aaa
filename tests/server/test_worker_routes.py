"""The routes a cache-aware router calls on a helios worker (helios/server/worker_routes.py,
docs/scaling.md): server and model info with real values, a generated health probe, flushing the
prefix cache (refused while requests run), the load, their authentication, and /health going
503 while the server drains."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from live import live_server, metrics, wait_until

from helios.config import ServerConfig

KEY = "worker-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PREFIX = "The same long system prompt every turn of this conversation repeats. " * 6


@pytest.fixture(scope="module")
def served(tiny_core: Path):
    config = ServerConfig(api_key=KEY, kv_pages=256, max_concurrency=8, aliases=("worker-alias",))
    with live_server(tiny_core, config) as served:
        yield served


def _completion(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": "x", "prompt": prompt, "max_tokens": max_tokens, "top_k": 1}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def test_server_and_model_info_report_the_served_model_and_limits(served) -> None:
    url, state = served
    card = httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    engine = state.client.metrics()
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(url + path, headers=AUTH, timeout=10).json()
        assert info["served_model_name"] == card["id"] == "worker-alias"
        assert info["model_path"] == card["root"]
        assert info["context_length"] == info["max_model_len"] == card["max_model_len"]
        assert info["max_running_requests"] == card["flare"]["max_concurrency"] == 8
        assert info["max_total_num_tokens"] == engine.total_pages * engine.page_tokens == 256 * engine.page_tokens
        assert info["page_size"] == engine.page_tokens
        assert info["dp_size"] == 1 and info["api_key_required"] is True
        assert info["flare"] == card["flare"]
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(url + path, headers=AUTH, timeout=10).json()
        assert info["served_model_name"] == "worker-alias" and info["model_path"] == card["root"]
        assert info["max_context_length"] == card["max_model_len"] and info["is_generation"] is True
        assert info["preferred_sampling_params"] == card["flare"]["sampling_defaults"]
        assert info["flare"] == card["flare"]


def test_worker_routes_take_the_serving_key_except_load(served) -> None:
    url, _ = served
    for method, path in [
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("GET", "/get_model_info"),
        ("GET", "/model_info"),
        ("GET", "/health_generate"),
        ("POST", "/flush_cache"),
    ]:
        refused = httpx.request(method, url + path, headers={"authorization": "Bearer wrong"}, timeout=10)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    load = httpx.get(url + "/get_load", timeout=10)
    assert load.status_code == 200 and load.json() == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0}


def test_health_generate_runs_one_token_through_the_engine(served) -> None:
    url, state = served
    before = state.client.metrics().generated_tokens
    response = httpx.get(url + "/health_generate", headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert state.client.metrics().generated_tokens == before + 1


def test_flush_drops_the_cached_prefix_and_is_refused_while_a_request_runs(served) -> None:
    url, state = served
    assert _completion(url, PREFIX + "first").status_code == 200
    reused = metrics(url)["reused_tokens"]
    assert _completion(url, PREFIX + "second").status_code == 200
    assert metrics(url)["reused_tokens"] > reused  # the shared prefix came from the cache
    assert metrics(url)["cached_pages"] > 0

    flushed = httpx.post(url + "/flush_cache", headers=AUTH, timeout=60)
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["dropped"]["pages"] > 0
    assert metrics(url)["cached_pages"] == 0
    reused = metrics(url)["reused_tokens"]
    assert _completion(url, PREFIX + "third").status_code == 200
    assert metrics(url)["reused_tokens"] == reused  # nothing left to reuse

    async def while_running() -> tuple[int, str, int]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "x", "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass  # the request now runs in the engine
                refused = await client.post(url + "/flush_cache", headers=AUTH)
                load = (await client.get(url + "/get_load")).json()["load"]
                async for _ in lines:
                    pass
                return refused.status_code, refused.json()["error"]["message"], load

    status, message, load = asyncio.run(while_running())
    assert status == 409 and "requests are open" in message
    assert load == 1
    assert httpx.post(url + "/flush_cache", headers=AUTH, timeout=60).status_code == 200  # idle again


def test_health_answers_503_while_draining(tiny_core: Path) -> None:
    with live_server(tiny_core, ServerConfig(kv_pages=64)) as (url, state):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        state.client.stop_admitting("the server is shutting down")
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        assert httpx.get(url + "/health_generate", timeout=10).status_code == 503
        wait_until(lambda: httpx.get(url + "/get_load", timeout=10).json()["load"] == 0, 10)
