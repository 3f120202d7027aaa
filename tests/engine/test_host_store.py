"""The host prefix store on a real tiny core: a long prefix evicted from the page pool comes
back from DRAM, then from disk after a restart, with identical output and logprobs; corrupt
records and records of another core are never served."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.engine.engine import EngineConfig, HostCacheConfig, LLMEngine
from helios.engine.host_store import HostStore, Record, identity_of
from helios.engine.kv_cache import ROOT_HASH, page_hash
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _prompt(core: Core, length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(10, core.manifest.tokenizer.vocab_size) for _ in range(length))


def _engine(core: Core, directory: Path | None, memory: int = 256 * MIB, pages: int = 300) -> LLMEngine:
    host = HostCacheConfig(memory_bytes=memory, directory=directory, disk_bytes=512 * MIB)
    return LLMEngine(core, EngineConfig(num_pages=pages, prefill_chunk_size=512, host_cache=host, compiled_step=False))


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
    assert host.stats.transfer_ns.cumulative()[-1][1] == 1 and host.stats.prefill_ns.sum > host.stats.transfer_ns.sum

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
    third = page_hash(page_hash(page_hash(ROOT_HASH, b"", conversation[:size]), b"", conversation[size : 2 * size]),
                      b"", conversation[2 * size : 3 * size])  # fmt: skip
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
