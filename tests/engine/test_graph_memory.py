"""Graph memory measured, not guessed: the KV pool leaves the captured graphs what capturing them
took on this host before (remembered per core, device, buckets and torch), the estimate only for
buckets never captured; and the CPU double measures nothing. The CUDA capture itself
(torch.cuda.memory_reserved around each bucket) needs a GPU: docs/performance.md, Device check."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios.engine import devices
from helios.engine.graphs import EagerBackend

MIB = 1 << 20


def test_measured_buckets_replace_the_estimate_with_headroom() -> None:
    buckets = (1, 2, 4, 8)
    assert devices.graph_reserve(buckets, None) == 4 * devices.GRAPH_RESERVE_PER_BUCKET
    measured = {1: 10 * MIB, 2: 10 * MIB, 4: 12 * MIB, 8: 20 * MIB}
    assert devices.graph_reserve(buckets, measured) == int(10 * MIB * 1.1) * 2 + int(12 * MIB * 1.1) + int(
        20 * MIB * 1.1
    )
    # A bucket the measurement lacks (added since) keeps the estimate; duplicates count once.
    partial = devices.graph_reserve((1, 1, 2, 16), {1: 4 * MIB, 2: 4 * MIB})
    assert partial == 2 * int(4 * MIB * devices.GRAPH_HEADROOM) + devices.GRAPH_RESERVE_PER_BUCKET


def test_the_pool_is_sized_from_what_the_measured_graphs_leave() -> None:
    free, page = 8000 * MIB, 2 * MIB
    estimated = devices.kv_pages_for(free, 0.9, page, devices.graph_reserve((1, 8, 64, 256), None))
    measured = devices.kv_pages_for(
        free, 0.9, page, devices.graph_reserve((1, 8, 64, 256), dict.fromkeys((1, 8, 64, 256), 300 * MIB))
    )
    assert estimated == (int(free * 0.9) - 4 * 32 * MIB) // page
    assert measured == (int(free * 0.9) - 4 * int(300 * MIB * 1.1)) // page
    with pytest.raises(devices.DeviceError, match="cuda_graphs = false"):
        devices.kv_pages_for(1000 * MIB, 0.9, page, devices.graph_reserve((1, 2), {1: 500 * MIB, 2: 500 * MIB}))


def test_measurements_are_remembered_per_core_device_buckets_and_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    key = devices.graph_memory_key("abc", "NVIDIA H200", (8, 1, 1), "2.11.0")
    assert key == devices.graph_memory_key("abc", "NVIDIA H200", (1, 8), "2.11.0")
    assert key != devices.graph_memory_key("abc", "NVIDIA H100 80GB HBM3", (1, 8), "2.11.0")
    assert key != devices.graph_memory_key("abc", "NVIDIA H200", (1, 8), "2.13.0")
    assert devices.remembered_graph_bytes(key) is None
    devices.remember_graph_bytes(key, {1: 5 * MIB, 8: 7 * MIB})
    assert devices.remembered_graph_bytes(key) == {1: 5 * MIB, 8: 7 * MIB}


def test_the_cpu_double_holds_no_graph_memory() -> None:
    backend = EagerBackend()
    backend.capture(4, dict)
    assert backend.capture_bytes() == {}
