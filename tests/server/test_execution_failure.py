"""Execution failures: 500 server_error when buffered, a terminal error event when streamed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from helios.config import ServerConfig
from helios.server.app import create_app
from helios.server.state import build_state

CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture()
def failing_client(tiny_core: Path):
    state = build_state(tiny_core, ServerConfig(kv_pages=64))

    def broken_run(chunks, memory=None):
        raise RuntimeError("device fault while running the step program")

    state.client.engine.executor.run = broken_run  # the step program fails, as a device error would
    with TestClient(app=create_app(state)) as client:
        yield client, state


def test_buffered_execution_failure_is_500(failing_client) -> None:
    client, state = failing_client
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "device fault" in error["message"]
    assert "x-request-id" in response.headers
    assert (
        state.client.engine.stats.failed == 1
        and state.client.engine.pool.num_free + state.client.engine.pool.num_cached == 64
    )
    assert client.get("/health").json() == {"status": "ok"}  # the runtime keeps serving


def test_streamed_execution_failure_is_a_terminal_event(failing_client) -> None:
    client, _ = failing_client
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert "[DONE]" not in events and len(events) == 1  # no role chunk before the first token
    assert json.loads(events[0])["error"]["type"] == "server_error"


DECISION = {
    "model": "x",
    "input": "Charged twice",
    "questions": [{"type": "predicate", "name": "refund", "instructions": "Refund requested?"}],
}


def test_scoring_failure_after_submission_carries_the_request_id(failing_client) -> None:
    """api.md: responses for requests that reach model submission carry x-request-id, errors too;
    a request refused before it (here a malformed body) has none."""
    client, _ = failing_client
    failed = client.post("/v1/decisions", json=DECISION)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert failed.headers.get("x-request-id", "").startswith("decision")
    refused = client.post("/v1/decisions", json={"model": "x"})
    assert refused.status_code in (400, 422) and "x-request-id" not in refused.headers
