"""The host-cache metrics api.md lists, moved by a scripted run of the tiny core through a small
pool with a host prefix store, and read back from both expositions (Prometheus text parsed with
the reference parser, and the JSON object) the way GET /metrics builds them."""

from __future__ import annotations

from pathlib import Path

import pytest
from metrics_checks import expositions_disagree
from prometheus_client.parser import text_string_to_metric_families

from helios.core import Core
from helios.engine import GREEDY, EngineConfig, EngineRequest, HostCacheConfig, LLMEngine, build_engine
from helios.engine.memory.kv_cache import ROOT_HASH, page_hash
from helios.engine.offline import run_to_completion
from helios.server.metrics import (
    FirstResponseWindow,
    ServerCounters,
    histograms_of,
    json_snapshot,
    prometheus_text,
    values_of,
)
from tests.engine.test_host_store import _prompt

MIB = 1 << 20
PAGES = 40


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _export(engine: LLMEngine) -> tuple[dict[tuple[str, tuple], float], dict]:
    """(Prometheus sample (name, sorted labels) -> value, the JSON object) of this engine's counters,
    both from one metrics snapshot the way GET /metrics renders them, and agreeing sample by sample."""
    metrics = engine.metrics()
    values = values_of(metrics, ServerCounters(0, 1, 0, {}))
    histograms = histograms_of(metrics)
    first = FirstResponseWindow().summary(now=0.0)
    text = prometheus_text(values, first, histograms)
    snapshot = json_snapshot(values, first, histograms)
    assert expositions_disagree(text, snapshot) == []
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples, snapshot


def _both(samples: dict, snapshot: dict, name: str, key: str, **labels: str) -> float:
    """One metric from both expositions, which must agree."""
    prom = samples[(name, tuple(sorted(labels.items())))]
    value = snapshot[key]
    if labels:
        value = value.get("/".join(labels.values()), 0)
    assert prom == value, (name, prom, value)
    return prom


def _histogram_count(samples: dict, snapshot: dict, name: str) -> float:
    prom = samples[(f"{name}_count", ())]
    assert samples[(f"{name}_bucket", (("le", "+Inf"),))] == prom
    assert snapshot[name.removeprefix("flare_")]["count"] == prom
    assert snapshot[name.removeprefix("flare_")]["buckets"]["+Inf"] == prom
    return prom


def test_host_cache_metrics_follow_a_scripted_run(tiny: Core, tmp_path: Path) -> None:
    size = tiny.manifest.limits.page_tokens
    probe = build_engine(tiny, EngineConfig(num_pages=8, compiled_step=False))
    page_bytes = probe.executor.page_bytes
    host = HostCacheConfig(
        memory_bytes=256 * MIB, directory=tmp_path, disk_bytes=512 * MIB, copy_queue_bytes=16 * page_bytes
    )
    engine = build_engine(
        tiny,
        EngineConfig(num_pages=PAGES, prefill_chunk_size=64, max_concurrency=2, host_cache=host, compiled_step=False),
    )
    m = lambda name, key, **labels: _both(*_export(engine), name, key, **labels)  # noqa: E731

    # At start: the pool is the local checkpoint pool (an attention core: pages only).
    assert m("flare_host_cache_slots_total", "host_cache_slots_total") == PAGES
    assert m("flare_host_cache_slots_in_use", "host_cache_slots_in_use") == 0
    assert m("flare_host_cache_intake_slots", "host_cache_intake_slots") == 16
    assert m("flare_host_cache_memory_records", "host_memory_records") == 0

    # One conversation: its 5 full pages are copied out and written to disk.
    conversation = _prompt(tiny, 5 * size + 3, seed=1)
    run_to_completion(engine, [EngineRequest("a", conversation, (GREEDY,), 4, ignore_eos=True)])
    engine.drain_copies()
    engine.host.flush()
    assert m("flare_host_cache_held_total", "host_cache_held", tier="dram") == 5
    assert m("flare_host_cache_held_total", "host_cache_held", tier="nvme") == 5
    assert m("flare_host_cache_memory_records", "host_memory_records") == 5
    assert m("flare_host_cache_disk_records", "host_disk_records") == 5
    assert m("flare_host_cache_bytes_out_total", "host_bytes_out") == 5 * page_bytes
    assert m("flare_host_cache_parked_records", "host_cache_parked_records") == 0
    assert m("flare_host_cache_copyout_pinned_records", "host_cache_copyout_pinned_records") == 0
    assert m("flare_host_cache_slots_in_use", "host_cache_slots_in_use") == 5  # the cached prefix pages
    assert m("flare_host_cache_hits_total", "host_hits") == 0
    samples, snapshot = _export(engine)
    assert _histogram_count(samples, snapshot, "flare_host_cache_missing_tokens") == 1

    # The same prompt again: a GPU prefix hit, and its chain is offered again (duplicates, skipped).
    run_to_completion(engine, [EngineRequest("a2", conversation, (GREEDY,), 4, ignore_eos=True)])
    engine.drain_copies()
    assert m("flare_cache_reused_tokens_total", "reused_tokens") == 5 * size
    assert m("flare_host_cache_store_skipped_total", "host_cache_store_skipped_total") == 5
    assert m("flare_host_cache_held_total", "host_cache_held", tier="dram") == 5

    # A tight pool: x finishes while a long prompt waits for more pages than pinning x's pages would
    # leave, so its offer is deferred (the engine never waits for the copier); the waiting prompt then
    # evicts x's pages before a retry finds headroom, so x's chain is dropped at its retry.
    deferrals = ("flare_host_cache_copyout_headroom_deferrals_total", "host_cache_copyout_headroom_deferrals_total")
    assert m(*deferrals) == 0
    run_to_completion(
        engine,
        [
            EngineRequest("x", _prompt(tiny, 10 * size + 3, seed=2), (GREEDY,), 2, ignore_eos=True),
            EngineRequest("y", _prompt(tiny, 10 * size + 3, seed=3), (GREEDY,), 30, ignore_eos=True),
            EngineRequest("z", _prompt(tiny, 25 * size + 3, seed=4), (GREEDY,), 2, ignore_eos=True),
        ],
    )
    engine.drain_copies()
    assert m(*deferrals) >= 1
    assert m("flare_host_cache_copyout_waits_total", "host_cache_copyout_waits_total") == 0
    assert m("flare_host_cache_dropped_total", "host_cache_dropped", tier="dram", reason="end_of_chain") >= 1
    assert engine.scheduler.copy_out.copies_deferred == 0  # retried (or given up) once the pool had room

    # The conversation's pages left the pool under that traffic: admission restores them from the store.
    assert engine.pool.page_of(page_hash(ROOT_HASH, b"", conversation[:size])) is None
    run_to_completion(engine, [EngineRequest("a3", conversation, (GREEDY,), 4, ignore_eos=True)])
    assert m("flare_host_cache_hits_total", "host_hits") == 1
    assert m("flare_host_cache_reused_tokens_total", "host_reused_tokens") == 5 * size
    assert m("flare_host_cache_bytes_in_total", "host_bytes_in") == 5 * page_bytes
    # The restoring step: its copies timed as a readiness wait, inside the step's own time.
    assert m("flare_replay_readiness_samples_total", "replay_readiness_samples") == 1
    assert 0 < m("flare_replay_readiness_wait_nanoseconds_total", "replay_readiness_wait_ns")
    assert m("flare_replay_readiness_wait_nanoseconds_total", "replay_readiness_wait_ns") < m(
        "flare_replay_gpu_nanoseconds_total", "replay_gpu_ns"
    )
    samples, snapshot = _export(engine)
    assert _histogram_count(samples, snapshot, "flare_host_cache_missing_tokens") == 6  # one per admission lookup
    assert _histogram_count(samples, snapshot, "flare_host_cache_estimated_transfer_ns") == 1  # one restoring lookup
    assert _histogram_count(samples, snapshot, "flare_host_cache_estimated_prefill_ns") == 1
    for tier, reason in (("dram", "oversize"), ("nvme", "io_error"), ("nvme", "oversize")):
        assert m("flare_host_cache_dropped_total", "host_cache_dropped", tier=tier, reason=reason) == 0
    engine.close()
    probe.close()


def test_oversize_and_io_error_drops_reach_both_expositions(tiny: Core, tmp_path: Path) -> None:
    """A memory tier smaller than one record drops it (dram, oversize); a corrupt disk record is
    dropped when read (nvme, io_error)."""
    size = tiny.manifest.limits.page_tokens
    engine = build_engine(
        tiny,
        EngineConfig(
            num_pages=PAGES,
            compiled_step=False,
            host_cache=HostCacheConfig(memory_bytes=1024, directory=tmp_path, disk_bytes=512 * MIB),
        ),
    )
    conversation = _prompt(tiny, 2 * size + 3, seed=5)
    run_to_completion(engine, [EngineRequest("a", conversation, (GREEDY,), 2, ignore_eos=True)])
    engine.drain_copies()
    engine.host.flush()
    m = lambda name, key, **labels: _both(*_export(engine), name, key, **labels)  # noqa: E731
    assert m("flare_host_cache_dropped_total", "host_cache_dropped", tier="dram", reason="oversize") == 2
    assert m("flare_host_cache_held_total", "host_cache_held", tier="nvme") == 2
    engine.close()
    for path in engine.host.directory.glob("*.rec"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = build_engine(
        tiny,
        EngineConfig(
            num_pages=PAGES,
            compiled_step=False,
            host_cache=HostCacheConfig(memory_bytes=256 * MIB, directory=tmp_path, disk_bytes=512 * MIB),
        ),
    )
    run_to_completion(restarted, [EngineRequest("b", conversation, (GREEDY,), 2, ignore_eos=True)])
    m = lambda name, key, **labels: _both(*_export(restarted), name, key, **labels)  # noqa: E731
    assert m("flare_host_cache_dropped_total", "host_cache_dropped", tier="nvme", reason="io_error") == 1
    assert m("flare_host_cache_hits_total", "host_hits") == 0  # the chain stopped at its corrupt head
    restarted.close()


def test_checkpoint_slots_count_pages_and_recurrent_state_slots() -> None:
    """A hybrid core's local checkpoint pool: KV pages plus live and snapshot state slots."""
    from helios.engine.memory.kv_cache import PagePool
    from helios.engine.memory.state_slots import StatePool
    from helios.engine.scheduler import Scheduler, SchedulerConfig

    pool, states = PagePool(10, 16), StatePool(2, 3)
    scheduler = Scheduler(SchedulerConfig(2, 64, 1024), pool, states=states)
    assert scheduler.copy_out.checkpoint_slots == (0, 15, 0)  # no host store: no copy-out intake
    pool.allocate()
    states.allocate()  # a live sequence's state row
    states.claim()  # a snapshot a step will capture
    assert scheduler.copy_out.checkpoint_slots == (3, 15, 0)
