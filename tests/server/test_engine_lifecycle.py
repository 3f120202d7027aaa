"""The engine lifecycle over HTTP: requests that can never run are refused at once, other
users' load never shortens an answer, cancelled and failed work frees its slot, a dead engine
fails every open request, and SIGTERM drains within its deadline."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from live import live_server, metrics, wait_until
from serving import start_server

from helios.config import ServerConfig

CHAT = {"model": "x", "top_k": 1, "seed": 7, "ignore_eos": True}  # greedy: top_k 1 (temperature 0 clamps to 0.01)


@pytest.fixture(scope="module")
def small_pool(tiny_core: Path):
    """Default concurrency (64) over a 40-page pool (640 token slots). Without speculation: the
    tiny model's greedy answers repeat themselves, and drafts would finish a "long" answer before
    the client below gives up on it."""
    with live_server(tiny_core, ServerConfig(kv_pages=40, speculation="off")) as served:
        yield served


def _chat(text: str, max_tokens: int, **extra) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}


def test_n_above_max_concurrency_is_refused_at_once_and_the_next_request_runs(small_pool) -> None:
    url, _ = small_pool
    start = time.monotonic()
    response = httpx.post(
        url + "/v1/completions", json={"model": "x", "prompt": "hi", "n": 100, "max_tokens": 4}, timeout=10
    )
    assert time.monotonic() - start < 1.0
    assert response.status_code == 400
    assert "max_concurrency" in response.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


class _CountingTokenizer:
    """The frontend's tokenizer, counting the texts it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner, self.encoded = inner, 0

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.encoded += len(texts)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_batches_that_can_never_run_together_are_refused_before_tokenizing(
    small_pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = small_pool
    counting = _CountingTokenizer(state.frontend.tokenizer)
    monkeypatch.setattr(state.frontend, "tokenizer", counting)
    start = time.monotonic()
    batch = httpx.post(
        url + "/v1/completions", json={"model": "x", "prompt": ["hi"] * 10_000, "max_tokens": 2}, timeout=30
    )
    assert batch.status_code == 400 and "max_concurrency" in batch.json()["error"]["message"]
    assert counting.encoded == 0  # refused from the body's shape, not after encoding 10,000 prompts
    assert time.monotonic() - start < 5.0  # (a loaded CI host took 1.1 s to parse and refuse the body)
    wide = httpx.post(
        url + "/v1/completions", json={"model": "x", "prompt": ["a", "b"], "n": 40, "max_tokens": 2}, timeout=30
    )
    assert wide.status_code == 400 and "80 choices" in wide.json()["error"]["message"]
    fits = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": ["a", "b"], "max_tokens": 2}, timeout=30)
    assert fits.status_code == 200 and counting.encoded >= 2  # the counter sees the prompts that are encoded


def test_other_users_load_never_shortens_an_answer(small_pool) -> None:
    url, _ = small_pool
    bodies = [_chat(f"user {i} asks a question", 300) for i in range(4)]
    before = metrics(url)["preemptions_total"]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
        return [r.json() for r in responses]

    shared = asyncio.run(together())
    assert metrics(url)["preemptions_total"] > before  # the pool was too small for all four at once
    for body, answer in zip(bodies, shared):
        assert answer["usage"]["completion_tokens"] == 300 and answer["choices"][0]["finish_reason"] == "length"
        alone = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
        assert answer["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_an_answer_larger_than_the_whole_pool_ends_with_length(small_pool) -> None:
    url, _ = small_pool
    answer = httpx.post(url + "/v1/chat/completions", json=_chat("go on", 1000), timeout=300).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] < 1000
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 40 * 16 + 1


def test_a_buffered_request_cancelled_by_its_client_frees_its_slot(small_pool) -> None:
    url, _ = small_pool
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(url + "/v1/chat/completions", json=_chat("a long one", 600), timeout=httpx.Timeout(30, read=0.1))
    waited = wait_until(lambda: (m := metrics(url))["active"] == 0 and m["http_admission_in_use"] == 0, timeout=1.5)
    assert waited < 1.0
    m = metrics(url)
    assert m["free_pages"] + m["cached_pages"] == m["total_pages"]


def test_a_dead_engine_fails_open_streams_at_once_and_health_turns_503(tiny_core: Path) -> None:
    with live_server(tiny_core, ServerConfig(kv_pages=64)) as (url, state):
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=_chat("stream", 3000, stream=True), timeout=30
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # generation is under way

            def broken_step():
                raise RuntimeError("scheduler invariant broken")

            killed = time.monotonic()
            state.client.engine.step = broken_step
            rest = [line for line in lines if line.startswith("data:")]
            assert time.monotonic() - killed < 1.0
        assert rest and "[DONE]" not in rest[-1]
        error = json.loads(rest[-1][5:])["error"]
        assert error["type"] == "server_error" and "scheduler invariant broken" in error["message"]
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "scheduler invariant broken" in health.json()["error"]["message"]
        refused = httpx.post(url + "/v1/chat/completions", json=_chat("hi", 4), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"


def test_sigterm_drains_within_the_deadline_and_ends_every_stream_cleanly(tiny_core: Path, tmp_path: Path) -> None:
    server = start_server(tiny_core, tmp_path, kv_pages=256, drain_seconds=2)

    async def one(client: httpx.AsyncClient, index: int, started: asyncio.Event, count: list[int]) -> str:
        body = _chat(f"stream {index}", 4000 if index % 2 else 40, stream=True)
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            last = ""
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    if not last:
                        count[0] += 1
                        if count[0] == 32:
                            started.set()
                    last = line
            return last

    async def scenario() -> tuple[list[str], float]:
        started, count = asyncio.Event(), [0]
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            tasks = [asyncio.create_task(one(client, i, started, count)) for i in range(32)]
            await asyncio.wait_for(started.wait(), 60)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            lasts = await asyncio.gather(*tasks)  # a cut connection would raise here
            await asyncio.get_running_loop().run_in_executor(None, server.process.wait, 30)
            return lasts, time.monotonic() - signalled

    try:
        lasts, elapsed = asyncio.run(scenario())
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert elapsed < 2 + 3, f"exit took {elapsed:.1f} s"
    for index, last in enumerate(lasts):
        if last == "data: [DONE]":
            continue  # finished within the drain window
        assert index % 2, "a short stream was cut instead of finishing"
        assert "shutting down" in json.loads(last[5:])["error"]["message"]
