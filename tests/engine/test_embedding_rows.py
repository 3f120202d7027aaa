"""The embedding row cache (helios/engine/memory/embedding_rows.py), hand-fed: a host table written
to a safetensors file as export writes it, read from RAM or through a memory map, gathered through
a small device cache (hits, misses, least-recently-used eviction, capacity, rows beyond the capacity
passing through, image-row substitution), and its counters in /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from helios.config import ConfigError, load_config
from helios.core.host_rows import DISK, RAM, open_table, row_ids
from helios.core.manifest import HostEmbedding
from helios.engine.memory.embedding_rows import RowCache, RowCacheConfig, delivery_ns, metrics
from helios.server.metrics import ServerCounters, json_snapshot, prometheus_text, values_of
from ignition import host_embeddings
from tests.server.metrics_checks import engine_metrics

ROWS, WIDTH = 40, 6


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HostEmbedding, torch.Tensor]:
    """(weights file's directory, its table's manifest entry, the table): the table between two
    other tensors of other dtypes, so its offset is not the start of the data."""
    root = tmp_path_factory.mktemp("core")
    table = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights = {"a_first": torch.arange(7, dtype=torch.float32), "table": table, "z_last": torch.ones(3, 3)}
    save_file(weights, str(root / "weights.safetensors"))
    (entry,) = host_embeddings.entries((("table", 0),), weights, root / "weights.safetensors")
    return root, entry, table


def cache(stored, capacity: int, source: str = RAM) -> RowCache:
    root, entry, _ = stored
    return RowCache(entry, open_table(root, entry, source), capacity, "cpu", torch.bfloat16)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_the_manifest_entry_locates_the_table_bytes(stored) -> None:
    root, entry, table = stored
    assert (entry.name, entry.input, entry.rows, entry.width, entry.dtype) == (
        "table",
        "table_rows",
        ROWS,
        WIDTH,
        "bfloat16",
    )
    for source in (RAM, DISK):
        assert torch.equal(open_table(root, entry, source), table)


def test_disk_and_ram_give_identical_rows(stored) -> None:
    _, _, table = stored
    step = ids(3, 17, 3, 39, 0, 17)
    ram, disk = cache(stored, 4, RAM), cache(stored, 4, DISK)
    for _ in range(3):
        got = ram.gather(step)
        assert torch.equal(got, disk.gather(step))
        assert torch.equal(got, table[step])
    assert (ram.stats.misses, ram.stats.host_bytes) == (disk.stats.misses, disk.stats.host_bytes)


def test_hits_misses_and_lookups_count_distinct_rows(stored) -> None:
    rows = cache(stored, 8)
    rows.gather(ids(1, 2, 2, 3))  # three distinct rows, all missing
    assert (rows.stats.lookups, rows.stats.hits, rows.stats.misses) == (3, 0, 3)
    assert rows.stats.host_bytes == 3 * WIDTH * 2 and rows.resident == 3
    rows.gather(ids(2, 3, 4))  # two resident, one new
    assert (rows.stats.lookups, rows.stats.hits, rows.stats.misses, rows.stats.evictions) == (6, 2, 4, 0)
    assert rows.stats.delivery_ns > 0 and delivery_ns({"table_rows": rows}) == rows.stats.delivery_ns


def test_least_recently_used_rows_are_evicted(stored) -> None:
    _, _, table = stored
    rows = cache(stored, 3)
    rows.gather(ids(1, 2, 3))
    rows.gather(ids(1))  # 2 is now the least recently used
    got = rows.gather(ids(4))
    assert torch.equal(got, table[ids(4)])
    assert rows.stats.evictions == 1 and set(rows.slots) == {1, 3, 4}
    rows.gather(ids(1, 3, 4))
    assert rows.stats.misses == 4  # all three were still resident
    rows.gather(ids(2))
    assert set(rows.slots) == {2, 3, 4}  # 1 was the oldest after the last step's order (1, 3, 4)


def test_a_step_wider_than_the_cache_gets_every_row(stored) -> None:
    _, _, table = stored
    rows = cache(stored, 2)
    step = ids(5, 6, 7, 8, 5, 9)
    assert torch.equal(rows.gather(step), table[step])
    assert rows.resident == 2 and rows.stats.misses == 5 and rows.stats.evictions == 0
    again = rows.gather(step)  # the two kept are hits; the rest pass through again, evicting none of this step's
    assert torch.equal(again, table[step])
    assert rows.stats.hits == 2 and rows.stats.misses == 8 and rows.resident == 2


def test_no_cache_reads_every_row_from_the_host(stored) -> None:
    _, _, table = stored
    rows = cache(stored, 0)
    for _ in range(2):
        assert torch.equal(rows.gather(ids(1, 2, 1)), table[ids(1, 2, 1)])
    assert (rows.stats.hits, rows.stats.misses, rows.resident) == (0, 4, 0)


def test_image_rows_take_the_image_row_id(stored) -> None:
    _, _, table = stored
    rows = cache(stored, 4)  # the entry's image_row_id is 0
    step, image_rows = ids(10, 11, 12, 13), ids(1, 2, -1)
    assert torch.equal(row_ids(step, image_rows, 0), ids(10, 0, 0, 13))
    assert torch.equal(row_ids(step, image_rows, None), step)
    assert torch.equal(row_ids(step, ids(-1), 0), step)
    assert torch.equal(rows.gather(step, image_rows), table[ids(10, 0, 0, 13)])


def test_an_upcast_cache_holds_float32_rows(stored) -> None:
    root, entry, table = stored
    rows = RowCache(entry, open_table(root, entry, DISK), 4, "cpu", torch.float32)
    got = rows.gather(ids(3, 4))
    assert got.dtype == torch.float32 and torch.equal(got, table[ids(3, 4)].float())
    assert rows.zeros(2).shape == (2, WIDTH) and rows.stats.lookups == 2


def test_a_table_past_the_file_is_refused(stored) -> None:
    root, entry, _ = stored
    from msgspec.structs import replace

    with pytest.raises(ValueError, match="re-export"):
        open_table(root, replace(entry, rows=ROWS * 100), RAM)
    with pytest.raises(ValueError, match="ram, disk"):
        open_table(root, entry, "tape")


def test_counters_reach_prometheus_and_json(stored) -> None:
    rows = cache(stored, 2)
    rows.gather(ids(1, 2, 3))  # 1 and 2 kept, 3 passes through
    rows.gather(ids(1, 4))  # 1 a hit, 4 evicts 2
    counted = metrics({"table_rows": rows})
    assert counted == {
        "embedding_row_lookups": 5,
        "embedding_row_hits": 1,
        "embedding_row_misses": 4,
        "embedding_row_evictions": 1,
        "embedding_row_host_bytes": 4 * WIDTH * 2,
        "embedding_rows_resident": 2,
        "embedding_row_capacity": 2,
    }
    values = values_of(engine_metrics(**counted), ServerCounters(0, 0, 0))
    text = prometheus_text(values, {})
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["flare_embedding_row_cache_lookups_total"] == 5
    assert samples["flare_embedding_row_cache_misses_total"] == 4
    assert samples["flare_embedding_row_cache_hits_total"] == 1
    assert samples["flare_embedding_row_cache_evictions_total"] == 1
    assert samples["flare_embedding_row_cache_rows"] == 2
    assert samples["flare_embedding_row_cache_capacity_rows"] == 2
    assert samples["flare_embedding_row_cache_host_bytes_total"] == 48
    snapshot = json_snapshot(values, {})
    assert snapshot["embedding_row_cache_misses_total"] == 4 and snapshot["embedding_row_cache_rows"] == 2
    # A core without host tables: every counter is there, at zero.
    empty = metrics({})
    assert set(empty.values()) == {0}
    zero = prometheus_text(values_of(engine_metrics(**empty), ServerCounters(0, 0, 0)), {})
    assert "flare_embedding_row_cache_hits_total 0.0" in zero


def test_the_server_knobs_are_checked(tmp_path: Path) -> None:
    config = tmp_path / "helios.toml"
    config.write_text('[server]\nembedding_row_cache_rows = 128\nembedding_rows_source = "disk"\n')
    loaded = load_config(config)
    assert (loaded.embedding_row_cache_rows, loaded.embedding_rows_source) == (128, "disk")
    assert (load_config().embedding_row_cache_rows, load_config().embedding_rows_source) == (
        RowCacheConfig().rows,
        RowCacheConfig().source,
    )
    for bad in ('embedding_rows_source = "tape"', "embedding_row_cache_rows = -1"):
        config.write_text(f"[server]\n{bad}\n")
        with pytest.raises(ConfigError):
            load_config(config)
