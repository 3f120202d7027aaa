"""A seeded, time-bounded soak over a small KV pool: 200 requests with random routes, n,
lengths, stops, logprobs, streaming, cancellations and disconnects. No request hangs, no
answer is shortened by the others' load, and afterwards every page is free or cached."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest
from serving import Server, running_server

REQUESTS = 200
PAGES = 24  # 384 token slots: every single request fits alone, the crowd does not


@pytest.fixture(scope="module")
def soak_server(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_server(tiny_core, tmp_path_factory.mktemp("soak"), kv_pages=PAGES, max_concurrency=16) as server:
        yield server


def _plan(rng: random.Random, index: int) -> dict:
    chat = rng.random() < 0.5
    body: dict = {
        "model": "x",
        "n": rng.choice([1, 1, 2, 3]),
        "max_tokens": rng.randint(1, 150),
        "ignore_eos": True,
        "seed": rng.randint(0, 1000),
        "stream": rng.random() < 0.5,
    }
    text = f"soak request {index}: " + " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 30))
    )
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["a", "e", "xyz", "\n"])]
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 5)} if chat else {"logprobs": rng.randint(0, 5)})
    action = rng.choices(["finish", "cancel", "disconnect"], weights=[6, 2, 2])[0]
    return {
        "route": "/v1/chat/completions" if chat else "/v1/completions",
        "body": body,
        "action": action,
        "cut_after": rng.randint(1, 5),
        "give_up": rng.uniform(0.05, 0.5),
    }


async def _run(client: httpx.AsyncClient, server: Server, plan: dict) -> None:
    body, url = plan["body"], server.url + plan["route"]
    if body["stream"]:
        body = {**body, "stream_options": {"include_usage": True}}
        events = []
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if plan["action"] == "cancel" and len(events) >= plan["cut_after"]:
                        return  # leaving the block disconnects mid-stream
        assert events[-1] == "[DONE]", events[-3:]
        _check_usage(plan, json.loads(events[-2])["usage"])
        return
    if plan["action"] == "disconnect":
        try:
            await client.post(url, json=body, timeout=httpx.Timeout(60, read=plan["give_up"]))
        except httpx.ReadTimeout:
            return  # the client left before the answer
        return
    response = await client.post(url, json=body)
    assert response.status_code == 200, response.text
    _check_usage(plan, response.json()["usage"])


def _check_usage(plan: dict, usage: dict) -> None:
    body = plan["body"]
    expected = body["n"] * body["max_tokens"]
    if "stop" in body:
        assert usage["completion_tokens"] <= expected
    else:  # nothing but max_tokens ends a choice: other requests' load must not shorten it
        assert usage["completion_tokens"] == expected, (body, usage)


def test_soak_leaves_no_hung_request_and_no_leaked_page(soak_server: Server) -> None:
    rng = random.Random(20261201)
    plans = [_plan(rng, i) for i in range(REQUESTS)]

    async def scenario() -> None:
        gate = asyncio.Semaphore(24)

        async def one(plan: dict) -> None:
            async with gate:
                await asyncio.wait_for(_run(client, soak_server, plan), timeout=120)  # a hang fails here

        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*(one(p) for p in plans))
        for _ in range(200):  # cancellations land after the engine's step in flight
            m = soak_server.metrics()
            if m["active"] == 0 and m["pending"] == 0 and m["http_admission_in_use"] == 0:
                break
            await asyncio.sleep(0.05)
        assert m["active"] == 0 and m["pending"] == 0 and m["http_admission_in_use"] == 0
        assert m["free_pages"] + m["cached_pages"] == m["total_pages"] and m["used_pages"] == 0
        assert m["failed"] == 0 and m["preemptions_total"] > 0

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    assert httpx.get(soak_server.url + "/health", timeout=5).status_code == 200
