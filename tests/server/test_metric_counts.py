"""api.md's request and reuse counters, moved by scripted sequences of requests and read back from
both /metrics expositions: completed and failed count requests by the outcome their client sees
(one per request, whatever its choices); reused_tokens counts device prefix-cache hits once per
admission, host-store restores going to host_reused_tokens only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient
from metrics_checks import expositions_disagree
from prometheus_client.parser import text_string_to_metric_families
from scripted import ScriptedServer, scripted_app
from test_driver import FakeRun, _chat_stream, _request, _update

from helios.config import ServerConfig
from helios.core import Core
from helios.engine import GREEDY, EngineConfig, EngineRequest, HostCacheConfig, LLMEngine, build_engine
from helios.engine.memory.kv_cache import ROOT_HASH, page_hash
from helios.engine.offline import run_to_completion
from helios.frontend.inference import Termination
from helios.protocols.encoding import OutputValidationError
from helios.server.app import create_app
from helios.server.driver import Drive
from helios.server.metrics import FirstResponseWindow, ServerCounters, json_snapshot, prometheus_text, values_of
from helios.server.outcomes import Outcome
from helios.server.state import build_state
from tests.engine.test_host_store import _prompt

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MIB = 1 << 20


# ---------------------------------------------------------------------------- completed and failed
def _counts(http: httpx.Client) -> tuple[int, int]:
    """(completed, failed), the same in the JSON object and the Prometheus text."""
    snapshot = http.get("/metrics?format=json").json()
    text = http.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert samples["flare_requests_completed_total"] == snapshot["completed"]
    assert samples["flare_requests_failed_total"] == snapshot["failed"]
    return snapshot["completed"], snapshot["failed"]


def _outcome(app: ScriptedServer, send: Callable[[], httpx.Response], status: int) -> tuple[int, int]:
    """What one request added to (completed, failed); a stream's outcome is counted as it ends, so
    the counters are read until they move (at most a few seconds)."""
    before = _counts(app.http)
    response = send()
    assert response.status_code == status, response.text
    deadline = time.monotonic() + 5
    while (after := _counts(app.http)) == before and time.monotonic() < deadline:
        time.sleep(0.02)  # waiting for the stream's end to be counted
    return after[0] - before[0], after[1] - before[1]


def _chat(app: ScriptedServer, **body) -> httpx.Response:
    return app.post("/v1/chat/completions", json={"model": "x", "messages": ASK, "max_tokens": 64, **body})


@pytest.fixture(scope="module")
def app(qwen3_core: Path):
    with scripted_app(qwen3_core, http_slots=6, max_concurrency=8, kv_pages=64) as server:
        yield server


def test_n_choices_are_one_request_and_a_string_stop_completes(app: ScriptedServer) -> None:
    app.say("Sunny and warm.")
    response = _chat(app, n=3)
    assert [c["message"]["content"] for c in response.json()["choices"]] == ["Sunny and warm."] * 3
    assert _outcome(app, lambda: _chat(app, n=3), 200) == (1, 0)  # three choices, one request
    app.say("It is sunny. STOP and more text the client never sees.")
    stopped = app.http.post(
        "/v1/chat/completions", json={"model": "x", "messages": ASK, "max_tokens": 64, "stop": ["STOP"]}
    )
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    app.say("It is sunny. STOP and more text the client never sees.")
    assert _outcome(app, lambda: _chat(app, stop=["STOP"]), 200) == (1, 0)  # the engine saw an abort
    app.say("It is sunny. STOP and more text the client never sees.")
    assert _outcome(app, lambda: _chat(app, stop=["STOP"], stream=True), 200) == (1, 0)


def test_tool_policy_and_output_validation_failures_are_failed(app: ScriptedServer) -> None:
    app.say("No tools needed.")
    assert _outcome(app, lambda: _chat(app, tools=[WEATHER], tool_choice="required"), 500) == (0, 1)
    app.say("No tools needed.")  # streamed: a terminal error event under HTTP 200
    assert _outcome(app, lambda: _chat(app, tools=[WEATHER], tool_choice="required", stream=True), 200) == (0, 1)
    app.say(CALL)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _outcome(app, lambda: _chat(app, tools=[WEATHER, TIME], tool_choice=named), 500) == (0, 1)
    app.say('<tool_call>\n{"name": "apply_patch", "arguments": {"input": 5}}\n</tool_call>')  # not a string input
    body = {"model": "m", "input": "Fix it.", "tools": [PATCH], "store": False, "max_output_tokens": 64}
    assert _outcome(app, lambda: app.post("/v1/responses", json=body), 500) == (0, 1)  # output validation


def test_admission_refusals_are_failed_and_validation_errors_are_not(app: ScriptedServer) -> None:
    state = app.state
    assert _outcome(app, lambda: _chat(app, temperature="hot"), 400) == (0, 0)  # malformed: never admitted
    assert _outcome(app, lambda: _chat(app, n=9), 400) == (0, 1)  # more choices than max_concurrency
    assert _outcome(app, lambda: _chat(app, n=7), 400) == (0, 1)  # more choices than HTTP slots
    held = state.slots.reserve(state.slots.capacity)  # every slot held by other requests
    assert held is not None
    try:
        assert _outcome(app, lambda: _chat(app), 429) == (0, 1)
    finally:
        held.release()
    # A prompt the pool can never hold with one page per choice: the engine refuses it at submission.
    size, pages = state.core.manifest.limits.page_tokens, state.client.engine.pool.num_pages
    prompt = [100] * ((pages - 3) * size)
    huge = {"model": "x", "prompt": prompt, "max_tokens": 1, "n": 4}
    refused = app.post("/v1/completions", json=huge)
    assert refused.status_code == 400 and "KV pages" in refused.json()["error"]["message"]
    assert _outcome(app, lambda: app.post("/v1/completions", json=huge), 400) == (0, 1)
    assert _outcome(app, lambda: _chat(app), 200) == (1, 0)  # still serving
    state.client.stop_admitting("paused for the test")  # last: the engine refuses from now on
    assert _outcome(app, lambda: _chat(app), 503) == (0, 1)


DECISION = {
    "model": "x",
    "input": "Charged twice",
    "questions": [
        {"type": "predicate", "name": "refund", "instructions": "Refund requested?"},
        {"type": "predicate", "name": "angry", "instructions": "Is the customer angry?"},
    ],
}


def test_scoring_requests_and_execution_failures_count_once(tiny_core: Path) -> None:
    state = build_state(tiny_core, ServerConfig(kv_pages=64))
    with TestClient(app=create_app(state)) as client:
        assert client.post("/v1/decisions", json=DECISION).status_code == 200
        assert _counts(client) == (1, 0)  # two questions, one request
        assert client.post("/v1/decisions", json={"model": "x"}).status_code in (400, 422)
        assert _counts(client) == (1, 0)  # refused before admission

        def broken_run(chunks, memory=None):
            raise RuntimeError("device fault while running the step program")

        state.client.engine.executor.run = broken_run
        assert client.post("/v1/decisions", json=DECISION).status_code == 500
        chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
        assert client.post("/v1/chat/completions", json=chat).status_code == 500
        assert _counts(client) == (1, 2)


def test_the_driver_counts_each_ending_once() -> None:
    """Completed once the answer's closing frames are made, failed at an error update or an encoder
    failure, and nothing when the client leaves."""

    async def finished():
        yield _update("Hi", Termination.EOS)

    async def failed():
        yield _update("", Termination.ERROR, "device fault")

    async def silent():
        await asyncio.Event().wait()
        yield _update("never")

    async def drive(run: FakeRun, encoder=None, cancel: bool = False) -> None:
        frames = Drive(run, encoder or _chat_stream(run.request)).frames()

        async def consume() -> None:
            async for _ in frames:
                pass

        task = asyncio.create_task(consume())
        if cancel:
            await asyncio.sleep(0.01)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    class Invalid:  # an encoder whose output validation fails at the end
        def __init__(self, request) -> None:
            self.inner = _chat_stream(request)

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def finish(self) -> list[bytes]:
            raise OutputValidationError("custom tool 'x' was called without a string input")

    runs = {
        "finished": FakeRun(_request(), finished),
        "failed": FakeRun(_request(), failed),
        "invalid": FakeRun(_request(), finished),
        "left": FakeRun(_request(), silent),
    }
    asyncio.run(drive(runs["finished"]))
    asyncio.run(drive(runs["failed"]))
    asyncio.run(drive(runs["invalid"], Invalid(runs["invalid"].request)))
    asyncio.run(drive(runs["left"], cancel=True))
    assert {name: run.outcomes for name, run in runs.items()} == {
        "finished": [Outcome.COMPLETED],
        "failed": [Outcome.FAILED],
        "invalid": [Outcome.FAILED],
        "left": [None],
    }


def test_the_snapshot_reads_request_outcomes_from_the_server() -> None:
    from metrics_checks import engine_metrics

    values = values_of(engine_metrics(completed=9, failed=4), ServerCounters(0, 1, 0, {}, completed=2, failed=1))
    first = FirstResponseWindow().summary(now=0.0)
    snapshot = json_snapshot(values, first)
    assert (snapshot["completed"], snapshot["failed"]) == (2, 1)  # not the engine's per-choice finishes
    assert expositions_disagree(prometheus_text(values, first), snapshot) == []


# ---------------------------------------------------------------------------- reused_tokens
@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _reuse(engine: LLMEngine) -> tuple[int, int]:
    """(reused_tokens, host_reused_tokens) as GET /metrics exports them, both expositions agreeing."""
    values = values_of(engine.metrics(), ServerCounters(0, 1, 0, {}))
    first = FirstResponseWindow().summary(now=0.0)
    snapshot = json_snapshot(values, first)
    assert expositions_disagree(prometheus_text(values, first), snapshot) == []
    return snapshot["reused_tokens"], snapshot["host_reused_tokens"]


def _run(engine: LLMEngine, *requests: tuple[str, tuple[int, ...], int, int]) -> None:
    """Requests (id, prompt, max_tokens, n) run together to completion, their pages copied out."""
    run_to_completion(
        engine,
        [EngineRequest(name, prompt, (GREEDY,) * n, tokens, ignore_eos=True) for name, prompt, tokens, n in requests],
    )
    engine.drain_copies()


def test_reused_tokens_count_device_hits_once_per_admission(tiny: Core, tmp_path: Path) -> None:
    size = tiny.manifest.limits.page_tokens
    host = HostCacheConfig(memory_bytes=256 * MIB, directory=tmp_path, disk_bytes=512 * MIB)
    engine = build_engine(
        tiny,
        EngineConfig(num_pages=24, prefill_chunk_size=64, max_concurrency=4, host_cache=host, compiled_step=False),
    )
    conversation = _prompt(tiny, 5 * size + 3, seed=1)
    _run(engine, ("cold", conversation, 4, 1))
    assert _reuse(engine) == (0, 0)
    _run(engine, ("warm", conversation, 4, 3))  # one admission of 5 cached pages, whatever its choices
    assert _reuse(engine) == (5 * size, 0)

    # Two growing requests through a 24-page pool: the newer one is preempted and readmitted onto its
    # own published pages, which is no new hit.
    preemptions = engine.metrics().preemptions
    _run(
        engine,
        ("old", _prompt(tiny, 3 * size + 1, seed=2), 10 * size, 1),
        ("new", _prompt(tiny, 3 * size + 1, seed=3), 10 * size, 1),
    )
    assert engine.metrics().preemptions > preemptions
    assert _reuse(engine) == (5 * size, 0)

    # That traffic evicted the conversation from the pool: the host store restores it, which is a
    # host hit only.
    assert engine.pool.page_of(page_hash(ROOT_HASH, b"", conversation[:size])) is None
    _run(engine, ("restored", conversation, 4, 1))
    assert engine.host is not None and engine.host.stats.hits == 1
    assert _reuse(engine) == (5 * size, 5 * size)
    engine.close()
