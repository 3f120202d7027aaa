"""64 concurrent streams, cancellation by disconnect, and what /metrics reports about it."""

from __future__ import annotations

import asyncio
import json

import httpx
from metrics_checks import expositions_disagree
from prometheus_client.parser import text_string_to_metric_families
from serving import Server


async def _stream(
    client: httpx.AsyncClient, server: Server, index: int, max_tokens: int, cut_after: int | None
) -> dict:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": f"stream {index}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.auth()) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                return {"done": True, "chunks": chunks}
            chunks.append(json.loads(line[5:]))
            if cut_after is not None and len(chunks) >= cut_after:
                return {"done": False, "chunks": chunks}  # leaving the block closes the connection
    return {"done": False, "chunks": chunks}


def test_64_streams_complete_and_32_cancelled_free_their_pages(server: Server) -> None:
    async def scenario() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            full = await asyncio.gather(*(_stream(client, server, i, 24, None) for i in range(64)))
            for result in full:
                assert result["done"]
                usage = result["chunks"][-1]["usage"]
                text_chunks = [c for c in result["chunks"][:-1] if c["choices"]]
                assert usage["completion_tokens"] == 24 and text_chunks[-1]["choices"][0]["finish_reason"] == "length"
            before = server.metrics()
            kept = [asyncio.create_task(_stream(client, server, 100 + i, 40, None)) for i in range(32)]
            cut = [asyncio.create_task(_stream(client, server, 200 + i, 900, 3)) for i in range(32)]
            await asyncio.gather(*cut)
            results = await asyncio.gather(*kept)
            assert all(r["done"] and r["chunks"][-1]["usage"]["completion_tokens"] == 40 for r in results)
            for _ in range(100):  # the engine applies aborts after its step in flight
                after = server.metrics()
                if after["active"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert after["active"] == 0 and after["pending"] == 0
            # The page gauges partition the pool: with nothing running, every page is free or cached.
            assert after["free_pages"] + after["cached_pages"] == after["total_pages"] and after["used_pages"] == 0
            generated = after["generated_tokens"] - before["generated_tokens"]
            assert 32 * 40 <= generated < 32 * 40 + 32 * 900 // 2  # the cut streams stopped early

    asyncio.run(scenario())


def test_metrics_text_parses_and_json_has_the_spec_fields(server: Server) -> None:
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "flare_generated_tokens",
        "flare_prefill_tokens",
        "flare_requests_completed",
        "flare_active_requests",
        "flare_free_kv_pages",
        "flare_total_kv_pages",
        "flare_kv_page_tokens",
        "flare_decode_weight_bytes",
    ):
        assert name in families, name
    histograms = [f.name for f in families.values() if f.type == "histogram"]
    assert sorted(histograms) == [
        "flare_host_cache_estimated_prefill_ns",
        "flare_host_cache_estimated_transfer_ns",
        "flare_host_cache_missing_tokens",
    ]
    snapshot = server.metrics()
    for field in (
        "prefill_tokens",
        "generated_tokens",
        "decode_weight_bytes",
        "active",
        "pending",
        "completed",
        "failed",
        "reused_tokens",
        "cached_pages",
        "free_pages",
        "total_pages",
        "page_tokens",
        "learned_drafter",
    ):
        assert field in snapshot
    assert snapshot["total_pages"] == 2048 and snapshot["learned_drafter"] is False
    assert set(snapshot["first_response"]) >= {"median_seconds", "samples", "window_seconds", "capacity", "truncated"}
    negotiated = httpx.get(server.url + "/metrics", headers={"accept": "application/json"})
    assert negotiated.headers["content-type"].startswith("application/json")
    assert httpx.get(server.url + "/metrics?format=xml").status_code == 400


def test_metrics_text_and_json_agree_sample_by_sample(server: Server) -> None:
    """GET /metrics in both formats, idle: every text sample equals its JSON field (uptime may tick
    between the two reads), and the text is what api.md names: format 0.0.4."""
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    snapshot = server.metrics()
    assert expositions_disagree(response.text, snapshot, skip=frozenset({"flare_uptime_seconds"})) == []
    uptime = {
        s.value
        for f in text_string_to_metric_families(response.text)
        for s in f.samples
        if f.name == "flare_uptime_seconds"
    }
    assert len(uptime) == 1 and 0 <= snapshot["uptime_seconds"] - uptime.pop() <= 1
