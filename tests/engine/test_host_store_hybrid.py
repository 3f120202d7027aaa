"""The host prefix store on tiny hybrid cores (gated DeltaNet + attention): a prefix is kept as its
page chain plus the recurrent-state snapshot at its end, so a restarted server restores both from
the disk tier with the uncached output; another core's records are never restored."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import TinyCores

from helios.core import Core
from helios.engine import EngineConfig, HostCacheConfig, LLMEngine, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY

MIB = 1 << 20
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 5


@pytest.fixture(scope="module")
def hybrids(tiny_cores: TinyCores) -> tuple[Core, Core]:
    """Two tiny Qwen3-Next cores (seeds 4 and 5; the first is the one test_hybrid_state serves)."""
    return Core.open(tiny_cores("qwen3_next", "qwen38", 4)[1]), Core.open(tiny_cores("qwen3_next", "qwen38", 5)[1])


def _engine(core: Core, directory: Path | None, **overrides) -> LLMEngine:
    host = HostCacheConfig(memory_bytes=64 * MIB, directory=directory, disk_bytes=256 * MIB)
    return build_engine(
        core, EngineConfig(**{"num_pages": 64, "prefill_chunk_size": 16, "host_cache": host, **overrides})
    )


def _request(core: Core, name: str) -> EngineRequest:
    prompt = tuple(core.tokenizer().encode(TEXT).ids)
    return EngineRequest(name, prompt, (GREEDY,), 10, ignore_eos=True, num_top_logprobs=2)


def test_a_restarted_hybrid_server_restores_pages_and_state_from_disk(hybrids, tmp_path: Path) -> None:
    core, _ = hybrids
    size = core.manifest.limits.page_tokens
    request = _request(core, "cold")
    assert len(request.prompt_ids) > 4 * size
    uncached = run_to_completion(build_engine(core, EngineConfig(num_pages=64, enable_prefix_cache=False)), [request])
    engine = _engine(core, tmp_path)
    cold = run_to_completion(engine, [request])["cold"][0]
    assert cold.token_ids == uncached["cold"][0].token_ids
    engine.drain_copies()
    engine.host.flush()
    assert engine.host.disk_records > (len(request.prompt_ids) - 1) // size  # pages and state records
    engine.close()

    restarted = _engine(core, tmp_path)
    assert restarted.host.memory_records == 0
    again = run_to_completion(restarted, [_request(core, "again")])["again"][0]
    last = (len(request.prompt_ids) - 1) // size * size
    assert again.num_cached_tokens == last and restarted.host.stats.hits == 1
    assert again.token_ids == cold.token_ids
    for x, y in zip(again.logprobs, cold.logprobs, strict=True):
        assert abs(x.logprob - y.logprob) <= 1e-4
    # the restored state was registered as a pool snapshot too: the next request resumes from the pool
    hits = restarted.host.stats.hits
    third = run_to_completion(restarted, [_request(core, "third")])["third"][0]
    assert third.num_cached_tokens == last and restarted.host.stats.hits == hits
    assert third.token_ids == cold.token_ids
    restarted.scheduler.check_invariants()
    restarted.drain_copies()
    restarted.close()


def test_another_cores_records_are_never_restored(hybrids, tmp_path: Path) -> None:
    mine, other = hybrids
    engine = _engine(mine, tmp_path)
    run_to_completion(engine, [_request(mine, "mine")])
    engine.close()
    theirs = _engine(other, tmp_path)
    assert theirs.host.directory != engine.host.directory and theirs.host.disk_records == 0
    theirs.close()
    # even records moved into the other core's directory are refused by their header
    moved = list(engine.host.directory.glob("*.rec"))
    theirs.host.directory.mkdir(parents=True, exist_ok=True)
    for path in moved:
        path.rename(theirs.host.directory / path.name)
    theirs = _engine(other, tmp_path)
    assert theirs.host.disk_records == len(moved) > 0
    got = run_to_completion(theirs, [_request(other, "theirs")])["theirs"][0]
    alone = run_to_completion(
        build_engine(other, EngineConfig(num_pages=64, enable_prefix_cache=False)), [_request(other, "theirs")]
    )["theirs"][0]
    assert got.num_cached_tokens == 0 and theirs.host.stats.hits == 0 and got.token_ids == alone.token_ids
    assert theirs.host.stats.dropped.get(("nvme", "io_error"), 0) >= 1
    theirs.close()
