"""Two helios replicas of the tiny core behind vllm-router's cache-aware policy, all on loopback
(docs/scaling.md): a shared long prefix lands on one replica, disjoint prefixes spread over both,
a killed replica's traffic moves to the other, SSE streams pass intact, and helios' request
extensions arrive (or are dropped where docs/scaling.md says the router drops them).

Runs only with FLARE_SLOW_TESTS=1 (two servers and a router take longer than CI's minute on a
2-core machine). The router is PyPI's vllm-router, pinned: from this environment when the `router`
extra is installed (pip install -e '.[router]'), else installed once into a virtual environment
under ~/.cache/flare (FLARE_ROUTER_VENV overrides); the tests skip, saying why, when it cannot be.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from serving import Server, _free_port, sse_events, start_server, stop_server
from support import slow_tests

ROUTER_VERSION = "0.1.17"
KEY = "router-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PREFIX = "You are the support assistant of a bicycle shop; answer briefly and politely. " * 10
GREEDY = {"model": "x", "top_k": 1, "seed": 3}

pytestmark = [
    pytest.mark.router,
    pytest.mark.skipif(
        not slow_tests(),
        reason="two replicas and a router run only with FLARE_SLOW_TESTS=1 (about 2 minutes on 2 cores)",
    ),
]


def router_command() -> list[str]:
    """The vllm-router launcher: this environment's, else the cached virtual environment's
    (created with pip on first use); pytest.skip when it cannot be installed."""
    here = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if here:
        return [here]
    venv = Path(os.environ.get("FLARE_ROUTER_VENV", Path.home() / ".cache" / "flare" / f"vllm-router-{ROUTER_VERSION}"))
    executable = venv / "bin" / "vllm-router"
    if not executable.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={ROUTER_VERSION}"],
                check=True,
                capture_output=True,
                text=True,
                timeout=900,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            detail = getattr(exc, "stderr", None) or str(exc)
            pytest.skip(f"vllm-router=={ROUTER_VERSION} could not be installed from PyPI: {str(detail)[-300:]}")
    return [str(executable)]


@dataclass
class Cluster:
    router: str
    replicas: list[Server]
    process: subprocess.Popen

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        return httpx.post(self.router + path, json=body, headers=headers, timeout=120, **kwargs)


def _metrics(server: Server) -> dict:
    return server.metrics()


def _counts(cluster: Cluster, field: str) -> list[int]:
    return [_metrics(server)[field] for server in cluster.replicas if server.process.poll() is None]


@pytest.fixture(scope="module")
def cluster(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    command = router_command()
    tmp = tmp_path_factory.mktemp("router")
    # No host prefix store: reuse stays in each replica's own pool (the disk tier would be shared).
    settings = {"api_key": KEY, "kv_pages": 512, "max_concurrency": 8, "host_cache": False}
    replicas = [start_server(tiny_core, tmp, **settings) for _ in range(2)]
    port = _free_port()
    log = open(tmp / "router.log", "w")
    process = subprocess.Popen(
        [
            *command,
            "--worker-urls",
            *(server.url for server in replicas),
            "--policy",
            "cache_aware",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(_free_port()),
            "--api-key",
            KEY,
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--cb-failure-threshold",
            "1",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp / "router.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the router did not become ready"
            try:
                if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # waiting for the port to open, not for a result
        yield Cluster(url, replicas, process)
    finally:
        process.terminate()
        process.wait(timeout=20)
        for server in replicas:
            stop_server(server)


def _completion(cluster: Cluster, prompt: str, max_tokens: int = 2) -> None:
    response = cluster.post("/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text


def test_a_shared_long_prefix_lands_on_one_replica(cluster: Cluster) -> None:
    reused, completed = _counts(cluster, "reused_tokens"), _counts(cluster, "completed")
    for turn in range(4):
        _completion(cluster, PREFIX + f"Question {turn}: do you repair brakes?")
    gained = [after - before for after, before in zip(_counts(cluster, "reused_tokens"), reused)]
    served = [after - before for after, before in zip(_counts(cluster, "completed"), completed)]
    assert sorted(served) == [0, 4], served
    prefix_tokens = len(PREFIX) // 8  # the tiny tokenizer's bytes-to-tokens ratio is far below 8
    assert max(gained) >= 3 * prefix_tokens and min(gained) == 0, gained


def test_disjoint_prefixes_spread_over_both_replicas(cluster: Cluster) -> None:
    completed = _counts(cluster, "completed")

    async def concurrently() -> None:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(index: int) -> None:
                body = {**GREEDY, "prompt": f"{index}{chr(65 + index) * 60}", "max_tokens": 24, "ignore_eos": True}
                response = await client.post(cluster.router + "/v1/completions", json=body, headers=AUTH)
                assert response.status_code == 200, response.text

            await asyncio.gather(*(one(index) for index in range(6)))

    asyncio.run(concurrently())
    served = [after - before for after, before in zip(_counts(cluster, "completed"), completed)]
    assert sum(served) == 6 and min(served) >= 1, served


def _stream(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> list[str]:
    response = httpx.post(url + path, json={**body, "stream": True}, headers={**AUTH, **(headers or {})}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse_events(response)


def _chat_text(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _finish(events: list[str]) -> str | None:
    """The stream's last finish_reason (chat and completions chunks alike)."""
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c.get("finish_reason")]
    return reasons[-1] if reasons else None


def test_sse_streams_pass_intact(cluster: Cluster) -> None:
    direct = cluster.replicas[1].url
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Name a tool."}], "max_tokens": 12}
    routed, expected = (
        _stream(cluster.router, "/v1/chat/completions", chat),
        _stream(direct, "/v1/chat/completions", chat),
    )
    # Same text and ending; the chunk count may differ: a replica that decoded this answer before
    # drafts it from its decoded history, so several tokens can arrive in one chunk.
    assert _chat_text(routed) == _chat_text(expected)
    assert _finish(routed) == _finish(expected) == "length"

    completion = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12}
    routed = _stream(cluster.router, "/v1/completions", completion)
    expected = _stream(direct, "/v1/completions", completion)
    assert routed[-1] == "[DONE]" and _finish(routed) == _finish(expected) == "length"
    texts = ["".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) for events in (routed, expected)]
    assert texts[0] == texts[1]

    # Responses: forwarded as the router's own request, carrying its --api-key (not the client's).
    response = {**GREEDY, "input": "Name a tool.", "max_output_tokens": 12}
    routed = _stream(cluster.router, "/v1/responses", response)
    kinds = [json.loads(event)["type"] for event in routed]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds

    # Messages: forwarded without the anthropic-version header, so helios refuses it (docs/scaling.md).
    message = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    refused = cluster.post("/v1/messages", message, headers={"anthropic-version": "2023-06-01", "x-api-key": KEY})
    assert refused.status_code == 400 and "anthropic-version" in refused.json()["error"]["message"]


def test_extensions_arrive_through_the_router(cluster: Cluster) -> None:
    body = {
        **GREEDY,
        "messages": [{"role": "user", "content": PREFIX + "Which bell?"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "logprob_token_ids": [1, 2],
        "return_tokens_as_token_ids": True,
        "prompt_logprobs": 1,
        "cache_salt": "tenant-a",
    }
    answer = cluster.post("/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    entries = answer.json()["choices"][0]["logprobs"]["content"]
    for entry in entries:  # logprob_token_ids replaced the alternatives; return_tokens_as_token_ids spelled them
        tokens = [alternative["token"] for alternative in entry["top_logprobs"]]
        assert tokens[:2] == ["token_id:1", "token_id:2"] and entry["token"].startswith("token_id:")
    assert answer.json()["prompt_logprobs"][0] is None and len(answer.json()["prompt_logprobs"]) > 1

    # cache_salt: the same prompt reuses its prefix under the same salt, not under another (prompt
    # scoring always starts uncached, so these requests do not ask for it).
    salted = {**GREEDY, "messages": [{"role": "user", "content": PREFIX + "Which lock?"}], "max_tokens": 2}
    cached = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        reply = cluster.post("/v1/chat/completions", {**salted, "cache_salt": salt})
        assert reply.status_code == 200, reply.text
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[1] > 0 and cached[2] == 0, cached

    # Reaching helios' validation proves the field arrived.
    chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    budget = cluster.post("/v1/chat/completions", {**chat, "thinking_token_budget": 8})
    assert budget.status_code == 400 and "thinking_token_budget" in budget.json()["error"]["message"]
    kwargs = cluster.post("/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}})
    assert kwargs.status_code == 400 and "chat_template_kwargs" in kwargs.json()["error"]["message"]

    # stream_options.continuous_usage_stats: the router drops it (usage only in the final chunk).
    options = {"include_usage": True, "continuous_usage_stats": True}
    routed = _stream(cluster.router, "/v1/chat/completions", {**chat, "stream_options": options})
    direct = _stream(cluster.replicas[1].url, "/v1/chat/completions", {**chat, "stream_options": options})
    assert all("usage" in json.loads(event) for event in direct[:-1])
    assert [("usage" in json.loads(event)) for event in routed[:-1]][-1] is True
    assert not any("usage" in json.loads(event) for event in routed[:-2])


def test_a_killed_replicas_traffic_moves_to_the_other(cluster: Cluster) -> None:
    served = _counts(cluster, "completed")
    _completion(cluster, PREFIX + "Which replica holds me?")
    holder = next(i for i, (now, before) in enumerate(zip(_counts(cluster, "completed"), served)) if now > before)
    victim, survivor = cluster.replicas[holder], cluster.replicas[1 - holder]
    before = _metrics(survivor)["completed"]

    async def running_then_killed() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {**GREEDY, "prompt": PREFIX + "A long answer", "max_tokens": 2000, "ignore_eos": True}
            body["stream"] = True
            try:
                async with client.stream("POST", cluster.router + "/v1/completions", json=body, headers=AUTH) as s:
                    async for line in s.aiter_lines():
                        if line.startswith("data:"):
                            os.kill(victim.process.pid, signal.SIGKILL)
                            break
            except httpx.HTTPError:
                pass  # the request the killed replica was running may fail: the only allowed failure

    asyncio.run(running_then_killed())
    victim.process.wait(timeout=20)
    for turn in range(4):  # sent after the kill: none may fail
        _completion(cluster, PREFIX + f"After the kill {turn}")
    assert _metrics(survivor)["completed"] >= before + 4
