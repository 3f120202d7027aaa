"""Every error status of the OpenAI routes, in the OpenAI error shape, against a real server."""

from __future__ import annotations

import gzip
import json
import threading
import zlib

import httpx
import pytest
from serving import API_KEY, Server, running_server

CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "param", "code"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


def test_authentication(server: Server) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        _error(httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers), 401, "authentication_error")
        _error(httpx.get(server.url + "/v1/models", headers=headers), 401, "authentication_error")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/metrics").status_code == 200


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 5.5}, "top_k"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a"], "stop_token_ids": [3]}, "stop"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"logprob_token_ids": list(range(129)), "logprobs": True}, "logprob_token_ids"),
        ({"logprob_token_ids": [10**9], "logprobs": True}, "logprob_token_ids"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"n": 0}, "n"),
    ],
)
def test_invalid_chat_requests(server: Server, patch: dict, param: str) -> None:
    error = _error(server.post("/v1/chat/completions", {**CHAT, **patch}), 400, "invalid_request_error")
    assert error["param"] is None and param in error["message"]  # spec: param is null; the message names the field


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "x", "prompt": []}, "prompt"),
        ({"model": "x", "prompt": [[]]}, "prompt"),
        ({"model": "x", "prompt": "a", "best_of": 3, "n": 1}, "best_of"),
        ({"model": "x", "prompt": "a", "suffix": "z"}, "suffix"),
        ({"model": "x", "prompt": [1, 10**8]}, "prompt"),
        ({"model": "x", "prompt": "a", "logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_completion_requests(server: Server, body: dict, param: str) -> None:
    error = _error(server.post("/v1/completions", body), 400, "invalid_request_error")
    assert error["param"] is None and param in error["message"]


def test_malformed_bodies(server: Server) -> None:
    headers = {**server.auth(), "content-type": "application/json"}
    _error(
        httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=headers),
        400,
        "invalid_request_error",
    )
    _error(
        httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]", headers=headers),
        400,
        "invalid_request_error",
    )
    encoded = {**headers, "content-encoding": "compress"}
    error = _error(
        httpx.post(server.url + "/v1/chat/completions", content=b"x", headers=encoded), 415, "invalid_request_error"
    )
    assert "compress" in error["message"]


def test_compressed_bodies_are_accepted(server: Server) -> None:
    raw = json.dumps(CHAT).encode()
    for encoding, data in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw))):
        headers = {**server.auth(), "content-type": "application/json", "content-encoding": encoding}
        assert (
            httpx.post(server.url + "/v1/chat/completions", content=data, headers=headers, timeout=60).status_code
            == 200
        )


def _gzip_bomb(size: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * (1 << 20)
    parts = [compressor.compress(block) for _ in range(size >> 20)]
    return b"".join(parts) + compressor.flush()


def test_gzip_bomb_is_refused_with_bounded_memory(server: Server) -> None:
    bomb = _gzip_bomb(1 << 30)  # 1 GiB of zeros, about 1 MB on the wire
    before = server.rss_bytes()
    headers = {**server.auth(), "content-type": "application/json", "content-encoding": "gzip"}
    response = httpx.post(server.url + "/v1/chat/completions", content=bomb, headers=headers, timeout=120)
    _error(response, 413, "request_too_large")
    # The decoded body is bounded by max_body_bytes (32 MiB); allow that twice over plus slack.
    assert server.rss_bytes() - before < 160 << 20
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_is_404(server: Server) -> None:
    error = _error(server.get("/v1/models/not-this-one"), 404, "invalid_request_error")
    assert error["code"] == "model_not_found"


def _hold_stream(server: Server, started: threading.Event, release: threading.Event, body: dict) -> threading.Thread:
    """A long stream in a thread: `started` once its first chunk arrived; closed after `release`."""

    def run() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=body, headers=server.auth(), timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()
                    release.wait(60)
                    break  # closing the stream cancels the generation

    thread = threading.Thread(target=run)
    thread.start()
    return thread


LONG = {**CHAT, "max_tokens": 900, "stream": True, "ignore_eos": True}


def test_admission_slots_exhausted_is_429(tiny_core, tmp_path) -> None:
    with running_server(tiny_core, tmp_path, http_slots=1) as server:
        started, release = threading.Event(), threading.Event()
        thread = _hold_stream(server, started, release, LONG)
        assert started.wait(60)
        _error(server.post("/v1/chat/completions", CHAT), 429, "rate_limit_error")
        release.set()
        thread.join()


def test_full_model_queue_is_503(tiny_core, tmp_path) -> None:
    with running_server(tiny_core, tmp_path, max_concurrency=1, queue_size=1) as server:
        first, release = threading.Event(), threading.Event()
        runner = _hold_stream(server, first, release, LONG)
        assert first.wait(60)
        waiting = httpx.Client(timeout=120)
        with waiting.stream("POST", server.url + "/v1/chat/completions", json=LONG) as queued:
            assert queued.status_code == 200  # accepted into the queue: SSE starts after enqueue
            _error(server.post("/v1/chat/completions", CHAT), 503, "server_error")
        release.set()
        runner.join()
