"""EngineClient: asyncio streaming from the engine thread, early exit aborts, queue bounds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helios.core import Core
from helios.engine import (
    GREEDY,
    EngineClient,
    EngineConfig,
    EngineMetrics,
    EngineRequest,
    FinishCause,
    QueueFull,
    RequestRejected,
    build_engine,
)


@pytest.fixture()
def client(tiny_core: Path):
    engine = build_engine(Core.open(tiny_core), EngineConfig(num_pages=128, max_pending=4, max_concurrency=2))
    client = EngineClient(engine).start()
    yield client
    client.shutdown()


def _request(name: str, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(name, (5, 6, 7, 8), (GREEDY,), max_tokens, ignore_eos=True)


def test_stream_and_abort_by_leaving(client: EngineClient) -> None:
    async def scenario():
        tokens = [t async for event in client.submit(_request("full")) for t in event.token_ids]
        assert len(tokens) == 8
        stream = client.submit(_request("left", max_tokens=500))
        async for _event in stream:
            break  # the consumer goes away after the first token
        await stream.aclose()
        for _ in range(200):
            if client.metrics().active == 0:
                break
            await asyncio.sleep(0.01)
        metrics = client.metrics()
        assert metrics.active == 0 and metrics.free_pages + metrics.cached_pages == metrics.total_pages == 128

    asyncio.run(scenario())


def test_rejections(client: EngineClient) -> None:
    async def scenario():
        with pytest.raises(RequestRejected, match="context limit"):
            client.submit(EngineRequest("x", (1,), (GREEDY,), 10**6))
        streams = []
        with pytest.raises(QueueFull):
            for index in range(64):  # 2 run, 4 wait, the rest are refused
                streams.append(client.submit(_request(f"q{index}", 400)))
        for stream in streams:
            await stream.aclose()

    asyncio.run(scenario())


def test_abort_by_id_finishes_with_abort(client: EngineClient) -> None:
    async def scenario():
        stream = client.submit(_request("victim", 1000))
        first = await stream.__anext__()
        client.abort("victim")
        causes = [first.finish] + [event.finish async for event in stream]
        assert causes[-1] is FinishCause.ABORT

    asyncio.run(scenario())


def test_metrics_is_a_frozen_snapshot_of_what_ran(client: EngineClient) -> None:
    """One call copies the engine's counters; later work changes the next snapshot, not this one."""
    before = client.metrics()
    assert isinstance(before, EngineMetrics) and before.device == "cpu" and before.host is None
    assert before.total_pages == 128 and before.free_pages == 128 and before.generated_tokens == 0
    assert dict(before.graph_launches) == {"graph": 0, "eager": 0} and before.learned_drafter is None
    with pytest.raises(AttributeError):
        before.generated_tokens = 1  # type: ignore[misc]

    async def scenario():
        return [t async for event in client.submit(_request("counted", 6)) for t in event.token_ids]

    assert len(asyncio.run(scenario())) == 6
    after = client.metrics()
    assert after.generated_tokens == 6 and after.prefill_tokens == 4 and after.completed == 1
    assert dict(after.graph_launches)["eager"] > 0 and before.generated_tokens == 0


def test_a_group_is_submitted_all_or_nothing(client: EngineClient) -> None:
    """A batch's children are checked, and bounded by the queue, as one group: a refused child
    leaves none of the others queued (api.md: every child is validated before the group is submitted)."""

    async def scenario():
        good = _request("good")
        too_many = EngineRequest("wide", (5, 6, 7, 8), (GREEDY,) * 3, 4)  # n 3 > max_concurrency 2
        with pytest.raises(RequestRejected):
            client.submit_group([good, too_many])
        with pytest.raises(QueueFull):  # max_pending 4: five children never fit, none is queued
            client.submit_group([_request(f"child{i}") for i in range(5)])
        assert client.metrics().pending == 0 and client.metrics().active == 0
        streams = client.submit_group([_request("a"), _request("b")])
        outputs = [[t async for event in stream for t in event.token_ids] for stream in streams]
        assert [len(tokens) for tokens in outputs] == [8, 8]
        again = [t async for event in client.submit(_request("good")) for t in event.token_ids]
        assert len(again) == 8  # the refused group left nothing behind under its ids

    asyncio.run(scenario())
