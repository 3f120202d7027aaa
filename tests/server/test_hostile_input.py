"""Hostile input at the HTTP layer: deep nesting, unknown routes and methods. Each gets the
protocol's error shape and the server keeps serving."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient
from live import live_server

from helios.config import ServerConfig
from helios.server.app import create_app
from helios.server.json_body import MAX_JSON_DEPTH, nesting_depth
from helios.server.state import build_state

CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client(tiny_core: Path):
    with TestClient(app=create_app(build_state(tiny_core, ServerConfig(kv_pages=64)))) as test_client:
        yield test_client


def _nested_schema(levels: int) -> str:
    """JSON text of an object schema `levels` properties deep (json.dumps would recurse too far)."""
    return '{"type": "object", "properties": {"x": ' * levels + '{"type": "string"}' + "}}" * levels


def test_nesting_depth_ignores_brackets_inside_strings() -> None:
    assert nesting_depth(b"[" * 100_000) == 100_000
    tricky = json.dumps({"a": "[" * 500 + '\\"' + "{" * 500, "b": [[["\\\\"]]]}).encode()
    assert json.loads(tricky) and nesting_depth(tricky) == 4
    assert nesting_depth(_nested_schema(100).encode()) == 201


@pytest.mark.parametrize(
    "route",
    ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/decisions", "/v1/systemone"],
)
def test_a_100000_deep_body_is_400_naming_the_limit(client: TestClient, route: str) -> None:
    response = client.post(route, content=b"[" * 100_000, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"limit is {MAX_JSON_DEPTH}" in message and "Recursion" not in message


def test_deep_tool_parameters_and_template_kwargs_are_400_not_500(client: TestClient) -> None:
    chat = json.dumps(CHAT)[:-1]
    tools = f', "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {_nested_schema(600)}}}}}]}}'
    deep = client.post("/v1/chat/completions", content=chat + tools)
    assert deep.status_code == 400 and "levels deep" in deep.json()["error"]["message"]
    deep = client.post(
        "/v1/chat/completions", content=chat + f', "chat_template_kwargs": {{"k": {_nested_schema(600)}}}}}'
    )
    assert deep.status_code == 400 and "levels deep" in deep.json()["error"]["message"]
    show = client.post("/api/show", content=b"[" * 100_000)
    assert show.status_code == 400 and "levels deep" in show.json()["error"]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_unknown_routes_and_methods_answer_in_the_protocol_shape(client: TestClient) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"type", "message", "param", "code"}
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and "GET is not allowed" in wrong.json()["error"]["message"]
    anthropic = client.post("/v1/messages/batches", json={})
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"


def test_slow_headers_close_the_connection_and_slow_bodies_get_408(tiny_core: Path) -> None:
    config = ServerConfig(kv_pages=64, header_timeout_seconds=1, body_timeout_seconds=1)
    with live_server(tiny_core, config) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as idle:
            started = time.monotonic()
            assert idle.recv(1024) == b""  # never sent a byte: closed by the header deadline
            assert 0.9 < time.monotonic() - started < 5
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # headers never finish
            assert slow.recv(1024) == b""
        with socket.create_connection((host, int(port)), timeout=10) as dripping:
            dripping.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"model"'
            )
            reply = b""
            while b"}}" not in reply and (piece := dripping.recv(4096)):
                reply += piece
            assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout_seconds" in reply
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_logit_bias_is_applied_not_ignored(client: TestClient) -> None:
    def tokens(**extra) -> list[str]:
        body = {
            "model": "x",
            "prompt": "hello",
            "max_tokens": 4,
            "top_k": 1,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **extra,
        }
        return client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    assert tokens(logit_bias={"42": 100}) == ["token_id:42"] * 4 != plain
    first = plain[0].removeprefix("token_id:")
    assert tokens(logit_bias={first: -100})[0] != plain[0]  # greedy avoids a banned token
    for bad in ({"x": 1}, {"42": 101}, {"99999999": 1}, [1, 2]):
        response = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": bad})
        assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"]


CHAIN = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(2800)) + 'r2800: "c"\n'


def test_hostile_grammars_get_400_on_every_route_and_the_server_lives(client: TestClient) -> None:
    lark = {"type": "grammar", "syntax": "lark", "definition": CHAIN}
    chat = client.post("/v1/chat/completions", json={**CHAT, "response_format": lark})
    assert chat.status_code == 400 and "rules" in chat.json()["error"]["message"]
    tool = {"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": CHAIN}}
    responses = client.post(
        "/v1/responses", json={"model": "x", "input": "hi", "max_output_tokens": 2, "tools": [tool]}
    )
    assert responses.status_code == 400 and "rules" in responses.json()["error"]["message"]
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "(k1{1000}){1000}"}}}
    messages = client.post(
        "/v1/messages",
        headers={"anthropic-version": "2023-06-01"},
        json={
            "model": "x",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_cache_salt_partitions_prefix_reuse(client: TestClient) -> None:
    secret = "You are the billing assistant of ACME. The vault code is 4711. " * 4

    def cached(salt: str | None) -> int:
        body = {**CHAT, "messages": [{"role": "system", "content": secret}, {"role": "user", "content": "hi"}]}
        if salt is not None:
            body["cache_salt"] = salt
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")  # tenant A's prompt is now in the cache
    assert cached("tenant-a") > 0  # A reuses its own prefix
    assert cached("tenant-b") == 0 and cached(None) == 0  # B, and unsalted guessers, learn nothing
    bad = client.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""})
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


def test_a_deep_traceback_is_logged_once_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from helios.core.logs import MAX_CHARS, log_failure

    def recurse(depth: int) -> int:
        return recurse(depth + 1)

    try:
        recurse(0)
    except RecursionError as exc:
        with caplog.at_level(logging.ERROR):
            log_failure(logging.getLogger("helios.server"), "internal error", exc)
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < MAX_CHARS + 200
    assert "RecursionError" in caplog.records[0].getMessage()
