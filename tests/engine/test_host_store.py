"""The host prefix store on a real tiny core: a long prefix evicted from the page pool comes
back from DRAM, then from disk after a restart, with identical output and logprobs; corrupt
records and records of another core are never served."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.engine import EngineConfig, HostCacheConfig, LLMEngine, build_engine
from helios.engine.memory.host_store import HostStore, Record, identity_of
from helios.engine.memory.kv_cache import ROOT_HASH, page_hash
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY

MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _prompt(core: Core, length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(10, core.manifest.tokenizer.vocab_size) for _ in range(length))


def _engine(core: Core, directory: Path | None, memory: int = 256 * MIB, pages: int = 300) -> LLMEngine:
    host = HostCacheConfig(memory_bytes=memory, directory=directory, disk_bytes=512 * MIB)
    return build_engine(
        core, EngineConfig(num_pages=pages, prefill_chunk_size=512, host_cache=host, compiled_step=False)
    )


def _ask(engine: LLMEngine, prompt: tuple[int, ...], name: str):
    request = EngineRequest(name, prompt, (GREEDY,), 8, ignore_eos=True, num_top_logprobs=3)
    return run_to_completion(engine, [request])[name][0]


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(x.logprob - y.logprob) <= 1e-5
        assert [t for t, _ in x.alternatives] == [t for t, _ in y.alternatives]


def test_an_evicted_prefix_is_restored_from_dram_then_from_disk_after_a_restart(tiny: Core, tmp_path: Path) -> None:
    conversation = _prompt(tiny, 4000, seed=1)
    engine = _engine(tiny, tmp_path)
    cold = _ask(engine, conversation, "cold")
    assert cold.num_cached_tokens == 0
    for i in range(3):  # other traffic: 3 x 250 pages through a 300-page pool evicts the conversation
        _ask(engine, _prompt(tiny, 4000, seed=10 + i), f"other{i}")
    size = tiny.manifest.limits.page_tokens
    assert engine.pool.page_of(page_hash(ROOT_HASH, b"", conversation[:size])) is None  # evicted from the pool
    host = engine.host
    assert host is not None and host.memory_records >= 249
    before = host.stats.hits
    warm = _ask(engine, conversation, "warm")
    assert host.stats.hits == before + 1 and warm.num_cached_tokens >= 3984 - 16
    _same(warm, cold)
    host.flush()
    assert host.disk_records >= 249 and host.stats.bytes_out > 0
    engine.close()

    assert host.stats.missing_tokens.cumulative()[-1][1] >= 5  # every admission's lookup is observed
    # the one restore is priced both ways (which is cheaper is a benchmark's question, not a timed test's)
    for estimate in (host.stats.transfer_ns, host.stats.prefill_ns):
        assert estimate.cumulative()[-1][1] == 1 and estimate.sum > 0

    restarted = _engine(tiny, tmp_path)  # a new process's view: only the disk tier survives
    assert restarted.host.memory_records == 0 and restarted.host.disk_records >= 249
    request = EngineRequest("again", conversation, (GREEDY,), 8, ignore_eos=True, num_top_logprobs=3)
    restarted.prefetch(request)  # what the engine client does at submission: disk reads off the engine thread
    deadline = time.monotonic() + 30
    while restarted.host.memory_records < 249 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert restarted.host.memory_records >= 249
    again = _ask(restarted, conversation, "again")
    assert again.num_cached_tokens >= 3984 - 16 and restarted.host.stats.bytes_in > 0
    _same(again, cold)
    restarted.close()


def test_a_corrupt_disk_record_is_dropped_counted_and_recomputed(tiny: Core, tmp_path: Path) -> None:
    conversation = _prompt(tiny, 600, seed=2)
    engine = _engine(tiny, tmp_path)
    cold = _ask(engine, conversation, "cold")
    engine.host.flush()
    engine.close()
    size = tiny.manifest.limits.page_tokens
    third = page_hash(
        page_hash(page_hash(ROOT_HASH, b"", conversation[:size]), b"", conversation[size : 2 * size]),
        b"",
        conversation[2 * size : 3 * size],
    )
    path = engine.host.directory / f"{third.hex()}.rec"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = _engine(tiny, tmp_path)
    warm = _ask(restarted, conversation, "warm")
    assert restarted.host.stats.dropped.get(("nvme", "io_error")) == 1
    assert warm.num_cached_tokens == 2 * size  # the chain stops at the corrupt page; the rest is recomputed
    _same(warm, cold)
    restarted.close()  # the recomputed page was offered again: its record is rewritten whole
    second = page_hash(page_hash(ROOT_HASH, b"", conversation[:size]), b"", conversation[size : 2 * size])
    fresh = HostStore(restarted.host.identity, MIB, tmp_path, 512 * MIB)
    assert fresh.fetch(third, second, conversation[2 * size : 3 * size]) is not None
    fresh.close()


def test_records_of_another_core_are_never_restored(tmp_path: Path) -> None:
    tokens = tuple(range(16))
    digest = page_hash(ROOT_HASH, b"", tokens)
    mine = HostStore(identity_of("core-a", "float32", 16, ((2, 16),)), MIB, tmp_path, 64 * MIB)
    mine.put([Record(digest, ROOT_HASH, tokens, torch.arange(64, dtype=torch.uint8))])
    mine.close()
    other_identity = identity_of("core-b", "float32", 16, ((2, 16),))
    other = HostStore(other_identity, MIB, tmp_path, 64 * MIB)
    assert other.directory != mine.directory and other.fetch(digest, ROOT_HASH, tokens) is None
    # even a record file moved into the other core's directory is refused by its header
    other.directory.mkdir(parents=True, exist_ok=True)
    (mine.directory / f"{digest.hex()}.rec").rename(other.directory / f"{digest.hex()}.rec")
    reopened = HostStore(other_identity, MIB, tmp_path, 64 * MIB)
    assert reopened.contains(digest) and reopened.fetch(digest, ROOT_HASH, tokens) is None
    assert reopened.stats.dropped == {("nvme", "io_error"): 1} and not reopened.contains(digest)
    reopened.close()
    other.close()


def test_dram_and_disk_stay_within_their_bounds(tmp_path: Path) -> None:
    store = HostStore(identity_of("c", "float32", 16, ()), 10 * 1024, tmp_path, 8 * 1024)
    parent = ROOT_HASH
    for index in range(40):
        tokens = tuple(range(index * 16, index * 16 + 16))
        digest = page_hash(parent, b"", tokens)
        store.put([Record(digest, parent, tokens, torch.full((1000,), index, dtype=torch.uint8))])
        parent = digest
    store.flush()
    assert store.memory_records == 10 and store.disk_records <= 8
    assert store.stats.dropped[("dram", "end_of_chain")] == 30
    store.close()


# ---------------------------------------------------------------------- the copier thread
def _slow_copier(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make the copier thread slow, so pins are held across several steps (not synchronization:
    nothing waits for it except the code under test)."""
    from helios.engine.memory import host_copy

    gather = host_copy._gather

    def slow(source, index):
        time.sleep(seconds)
        return gather(source, index)

    monkeypatch.setattr(host_copy, "_gather", slow)


def _stress_requests(core: Core) -> list[EngineRequest]:
    """Twelve requests over three shared prefixes of 5 pages, with tails of 1-4 pages."""
    size = core.manifest.limits.page_tokens
    heads = [_prompt(core, 5 * size, seed=100 + k) for k in range(3)]
    return [
        EngineRequest(
            f"r{i}", heads[i % 3] + _prompt(core, size * (1 + i % 4) + 3, seed=200 + i), (GREEDY,), 20, ignore_eos=True
        )
        for i in range(12)
    ]


def test_concurrent_traffic_through_a_tiny_pool_with_a_slow_copier(tiny: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins survive several steps, yet no page is copied after it was reused (every record equals a
    fresh prefill's KV), no admission fails or output changes because of them, the engine never
    waits for the copier (offers the pool lacks headroom for are deferred and retried instead), and
    the pool is whole again at idle."""
    _slow_copier(monkeypatch, 0.003)
    requests = _stress_requests(tiny)
    fresh = build_engine(tiny, EngineConfig(num_pages=400, prefill_chunk_size=64, compiled_step=False))
    expected = run_to_completion(fresh, requests)
    host = HostCacheConfig(memory_bytes=256 * MIB, directory=None, disk_bytes=0)
    engine = build_engine(
        tiny, EngineConfig(num_pages=24, prefill_chunk_size=64, max_concurrency=4, host_cache=host, compiled_step=False)
    )
    for request in requests:
        engine.add(request)
    outputs: dict[str, list] = {}
    pinned_across_steps = 0
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).append(event)
        engine.scheduler.check_invariants()  # pins are counted as references of their pages
        pinned_across_steps += engine.scheduler.copy_out.copies_pending
    stats = engine.host.stats
    assert pinned_across_steps > 0 and stats.copy_deferrals > 0 and stats.copy_waits == 0
    for request in requests:
        tokens = tuple(t for event in outputs[request.request_id] for t in event.token_ids)
        assert (
            outputs[request.request_id][-1].finish is FinishCause.LENGTH
            and outputs[request.request_id][-1].error is None
        )
        assert tokens == tuple(expected[request.request_id][0].token_ids)
    engine.drain_copies()
    pool = engine.pool
    assert not engine.scheduler.copy_out.copies_pending and pool.ref_count == [0] * pool.num_pages
    assert pool.num_available == pool.num_pages  # every page free or evictable again
    store = engine.host
    records = list(store._dram.values()) + list(store._anchors.values())
    assert len(records) >= 5  # deferred offers whose pages the tiny pool evicted meanwhile were dropped
    for record in records:  # each record is the KV a fresh prefill computed for its chain
        page = fresh.pool.page_of(record.digest)
        assert page is not None
        want = fresh.executor.read_pages([page])[0].view(torch.float32)
        assert torch.allclose(record.payload.view(torch.float32), want, atol=1e-4, rtol=1e-4), record.digest.hex()
    engine.close()


def test_a_copier_that_is_behind_drops_the_chains_end_counted(tiny: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_copier(monkeypatch, 0.01)
    page_bytes = None
    probe = build_engine(tiny, EngineConfig(num_pages=64, compiled_step=False))
    page_bytes = probe.executor.page_bytes
    host = HostCacheConfig(memory_bytes=256 * MIB, directory=None, disk_bytes=0, copy_queue_bytes=4 * page_bytes)
    engine = build_engine(
        tiny, EngineConfig(num_pages=64, prefill_chunk_size=512, host_cache=host, compiled_step=False)
    )
    size = tiny.manifest.limits.page_tokens
    first = _prompt(tiny, 10 * size + 5, seed=3)
    second = _prompt(tiny, 10 * size + 5, seed=4)
    run_to_completion(
        engine,
        [
            EngineRequest("a", first, (GREEDY,), 2, ignore_eos=True),
            EngineRequest("b", second, (GREEDY,), 2, ignore_eos=True),
        ],
    )
    engine.drain_copies()
    store = engine.host
    # both finished in one step: the first's head took the 4 pages the bound allows, the rest waited for nothing
    assert store.memory_records == 4 and store.stats.dropped[("dram", "end_of_chain")] == 20 - 4
    assert store.fetch(page_hash(ROOT_HASH, b"", first[:size]), ROOT_HASH, first[:size]) is not None
    assert store.stats.copy_waits == 0
    engine.close()


def test_the_engine_thread_copies_nothing_when_the_pool_has_room(tiny: Core) -> None:
    """The counters of the engine thread's copy-out work: before this change every page was read on
    the engine thread between steps; now the copier thread reads them and the engine never waits."""
    engine = _engine(tiny, None, pages=600)
    _ask(engine, _prompt(tiny, 2000, seed=5), "one")
    _ask(engine, _prompt(tiny, 2000, seed=6), "two")
    engine.drain_copies()
    copier = engine.scheduler.copy_out.copier
    assert engine.host.memory_records >= 2 * 125 and copier.worker_ns > 0
    assert engine.host.stats.copy_waits == 0 and engine.host.stats.copy_wait_ns == 0
    engine.close()


# ---------------------------------------------------------------------- conversation anchors
def test_dram_evicts_other_records_before_an_anchors_chain(tmp_path: Path) -> None:
    store = HostStore(identity_of("c", "float32", 16, ()), 10 * 1000, None, 0)
    parent, anchors = ROOT_HASH, []
    for index in range(24):
        tokens = tuple(range(index * 16, index * 16 + 16))
        digest = page_hash(parent, b"", tokens)
        store.put([Record(digest, parent, tokens, torch.full((1000,), index, dtype=torch.uint8), anchor=index < 4)])
        anchors += [digest] if index < 4 else []
        parent = digest
    assert store.memory_records == 10 and store.anchor_records == 4
    assert all(store.contains(d) for d in anchors)
    assert store.stats.dropped[("dram", "end_of_chain")] == 14
    # anchors past half of the tier go oldest first: the other records keep the other half
    for index in range(24, 34):
        tokens = tuple(range(index * 16, index * 16 + 16))
        store.put(
            [
                Record(
                    page_hash(ROOT_HASH, b"", tokens),
                    ROOT_HASH,
                    tokens,
                    torch.zeros(1000, dtype=torch.uint8),
                    anchor=True,
                )
            ]
        )
    assert store.memory_records == 10 and store.anchor_records == 5 and not store.contains(anchors[0])
    store.close()


def test_an_anchors_pages_survive_dram_pressure_that_evicts_the_rest(tiny: Core) -> None:
    size = tiny.manifest.limits.page_tokens
    system = _prompt(tiny, 20 * size, seed=7)  # the leading system + tools block: 20 pages

    def anchored(request_id: str, pages: int, seed: int) -> EngineRequest:
        """The system block, hinted as an anchor, then `pages` pages of the request's own."""
        prompt = system + _prompt(tiny, pages * size, seed=seed)
        return EngineRequest(
            request_id, prompt, (GREEDY,), 4, ignore_eos=True, checkpoint_hints=((len(system), "anchor"),)
        )

    first = anchored("first", 30, 8)
    probe = build_engine(tiny, EngineConfig(num_pages=64, compiled_step=False))
    memory = 60 * probe.executor.page_bytes  # the DRAM tier holds 60 pages
    engine = _engine(tiny, None, memory=memory, pages=200)
    run_to_completion(engine, [first])
    engine.drain_copies()
    assert engine.host.anchor_records == 20
    for i in range(3):  # other traffic: 3 x 50 pages through a 60-page tier
        _ask(engine, _prompt(tiny, 50 * size, seed=20 + i), f"other{i}")
        engine.drain_copies()
    for i in range(4):  # and through the pool
        _ask(engine, _prompt(tiny, 50 * size, seed=30 + i), f"more{i}")
    engine.drain_copies()
    store = engine.host
    assert store.anchor_records == 20 and store.stats.dropped[("dram", "end_of_chain")] > 100
    later = anchored("later", 10, 9)
    hits = store.stats.hits
    assert engine.pool.page_of(page_hash(ROOT_HASH, b"", system[:size])) is None  # not from the pool
    warm = run_to_completion(engine, [later])["later"][0]
    assert store.stats.hits == hits + 1 and warm.num_cached_tokens == len(system)
    alone = run_to_completion(build_engine(tiny, EngineConfig(num_pages=200, compiled_step=False)), [later])["later"][0]
    assert warm.token_ids == alone.token_ids
    engine.close()


def test_after_a_restart_the_engine_thread_never_reads_disk(
    tiny: Core, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission waits for the prefetch thread's reads (other requests keep stepping meanwhile)
    and then restores from memory: the engine thread does no disk reads or checksums."""
    import asyncio
    import threading

    from helios.engine.client import EngineClient

    conversation = _prompt(tiny, 2000, seed=3)
    first = _engine(tiny, tmp_path)
    cold = _ask(first, conversation, "cold")
    first.host.flush()
    first.close()

    engine = _engine(tiny, tmp_path)
    readers: list[str] = []
    real_read = HostStore._read

    def slow_read(store: HostStore, digest: bytes):
        readers.append(threading.current_thread().name)
        time.sleep(0.002)  # a slow disk: the engine would reach admission long before the reads end
        return real_read(store, digest)

    monkeypatch.setattr(HostStore, "_read", slow_read)
    client = EngineClient(engine).start()
    try:

        async def scenario():
            async def collect(request: EngineRequest):
                tokens = []
                async for event in client.submit(request):
                    tokens += event.token_ids
                return tokens

            other = EngineRequest("other", _prompt(tiny, 40, seed=99), (GREEDY,), 30, ignore_eos=True)
            warm = EngineRequest("warm", conversation, (GREEDY,), 8, ignore_eos=True, num_top_logprobs=3)
            return await asyncio.gather(collect(other), collect(warm))

        other_tokens, warm_tokens = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert len(other_tokens) == 30 and warm_tokens == list(cold.token_ids)
    assert len(readers) >= 120 and set(readers) == {"helios-host-prefetch"}
    assert engine.host.stats.hits == 1 and engine.host.stats.reused_tokens >= 1984 - 16
    engine.close()
