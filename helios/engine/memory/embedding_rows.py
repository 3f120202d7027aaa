"""The embedding row cache: rows of a host-resident embedding table (manifest.HostEmbedding, a core
exported with --host-embeddings) kept in the execution device's memory, keyed by table row (the
token id, or the image-row id at image positions), least recently used out.

Such a table (Gemma 4's per-layer input embeddings: several GB in E2B/E4B) stays off the device; the
step programs take each step row's table row as an input. Before a program runs, the executor asks
the cache for the rows of the step's tokens (`RowCache.gather`): resident rows are hits; misses are
read from the host table, which is in RAM (read once at startup) or a memory map of the core's
weights file (`disk`: the page cache or the disk serves each read), copied to the device, and kept
there while there is room. A step needing more distinct rows than the cache holds still gets every
row: those beyond the capacity pass through uncached. The rows are the table's bytes, so the
programs compute exactly what they would over the table itself.

The time spent delivering missed rows (host read plus the copy to the device) is the engine's
readiness wait (api.md replay_readiness_wait_ns) for both sources.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.core import Core
from helios.core.host_rows import SOURCES, open_table, row_bytes, row_ids
from helios.core.manifest import HostEmbedding


@dataclass(frozen=True, slots=True)
class RowCacheConfig:
    """[server] embedding_row_cache_rows and embedding_rows_source (helios.config)."""

    rows: int = 8192  # device rows per table; 0: no cache, every row is read from the host each step
    source: str = "ram"  # "ram": the table read into memory at startup; "disk": read through a memory map


@dataclass(slots=True)
class RowCacheStats:
    lookups: int = 0  # distinct table rows asked for, one per distinct row per program run
    hits: int = 0  # of those, rows found on the device
    misses: int = 0  # of those, rows read from the host table
    evictions: int = 0  # resident rows dropped for a missed one
    host_bytes: int = 0  # bytes read from the host table
    delivery_ns: int = 0  # time reading missed rows and copying them to the device


class RowCache:
    """One host table's device rows (at most `capacity`), least recently used out."""

    def __init__(self, entry: HostEmbedding, table: Tensor, capacity: int, device: str, dtype: torch.dtype) -> None:
        """table: the host rows [rows, width] on the CPU (open_table); dtype: the program input's
        (the table's, or float32 on a CPU serving a 16-bit core upcast)."""
        self.entry = entry
        self.table = table
        self.capacity = capacity
        self.device = device
        self.dtype = dtype
        self.rows = torch.empty(capacity, entry.width, dtype=dtype, device=device)
        self.slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # table row -> slot, oldest first
        self.free = list(reversed(range(capacity)))
        self.row_bytes = row_bytes(entry)  # as stored: what a miss reads from the host table
        self.stats = RowCacheStats()

    @property
    def resident(self) -> int:
        return len(self.slots)

    def zeros(self, count: int) -> Tensor:
        """An input of `count` rows whose values do not matter (probes; nothing is counted)."""
        return torch.zeros(count, self.entry.width, dtype=self.dtype, device=self.device)

    def gather(self, token_ids: Tensor, image_rows: Tensor | None = None) -> Tensor:
        """The program input [T, width] on the device: each step row's table row (image rows: the
        entry's image_row_id's)."""
        ids = row_ids(token_ids.cpu(), image_rows, self.entry.image_row_id)
        unique, inverse = torch.unique(ids, return_inverse=True)
        wanted = unique.tolist()
        hit_at, hit_slots, miss_at, missed = [], [], [], []
        for position, row in enumerate(wanted):
            slot = self.slots.get(row)
            if slot is None:
                miss_at.append(position)
                missed.append(row)
            else:
                self.slots.move_to_end(row)
                hit_at.append(position)
                hit_slots.append(slot)
        self.stats.lookups += len(wanted)
        self.stats.hits += len(hit_at)
        self.stats.misses += len(missed)
        out = torch.empty(len(wanted), self.entry.width, dtype=self.dtype, device=self.device)
        if hit_at:
            out.index_copy_(0, self._index(hit_at), self.rows.index_select(0, self._index(hit_slots)))
        if missed:
            started = time.perf_counter_ns()
            fetched = self.table.index_select(0, torch.tensor(missed, dtype=torch.int64))
            fetched = fetched.to(device=self.device, dtype=self.dtype)
            out.index_copy_(0, self._index(miss_at), fetched)
            self._admit(missed, fetched, set(wanted))
            self.stats.delivery_ns += time.perf_counter_ns() - started
            self.stats.host_bytes += len(missed) * self.row_bytes
        return out.index_select(0, self._index(inverse))

    def _admit(self, missed: list[int], fetched: Tensor, now: set[int]) -> None:
        """Keep the missed rows: a free slot, else the least recently used row's. This step's rows
        (`now`) were moved or added to the end, so the oldest row is one of them only when all are:
        then the remaining misses pass through uncached."""
        slots: list[int] = []
        kept: list[int] = []
        for index, row in enumerate(missed):
            if self.free:
                slot = self.free.pop()
            else:
                oldest = next(iter(self.slots), None)
                if oldest is None or oldest in now:
                    break
                slot = self.slots.pop(oldest)
                self.stats.evictions += 1
            self.slots[row] = slot
            slots.append(slot)
            kept.append(index)
        if slots:
            self.rows.index_copy_(0, self._index(slots), fetched.index_select(0, self._index(kept)))

    def _index(self, values: list[int] | Tensor) -> Tensor:
        if isinstance(values, Tensor):
            return values.to(self.device)
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def open_caches(core: Core, device: str, config: RowCacheConfig, upcast: bool) -> dict[str, RowCache]:
    """The step input name -> its table's row cache, for each host table of the core (none for most)."""
    if config.source not in SOURCES:
        raise ValueError(f"embedding rows source must be one of {', '.join(SOURCES)}, got {config.source!r}")
    caches: dict[str, RowCache] = {}
    for entry in core.manifest.host_embeddings:
        dtype = getattr(torch, entry.dtype)
        if upcast and dtype in (torch.bfloat16, torch.float16):
            dtype = torch.float32
        caches[entry.input] = RowCache(entry, open_table(core.root, entry, config.source), config.rows, device, dtype)
    return caches


def metrics(caches: dict[str, RowCache]) -> dict[str, int]:
    """EngineMetrics' embedding row-cache fields, summed over the core's tables (all 0 without one)."""
    stats = [cache.stats for cache in caches.values()]
    return {
        "embedding_row_lookups": sum(s.lookups for s in stats),
        "embedding_row_hits": sum(s.hits for s in stats),
        "embedding_row_misses": sum(s.misses for s in stats),
        "embedding_row_evictions": sum(s.evictions for s in stats),
        "embedding_row_host_bytes": sum(s.host_bytes for s in stats),
        "embedding_rows_resident": sum(cache.resident for cache in caches.values()),
        "embedding_row_capacity": sum(cache.capacity for cache in caches.values()),
    }


def delivery_ns(caches: dict[str, RowCache]) -> int:
    """Nanoseconds spent delivering missed rows so far (the engine's readiness wait)."""
    return sum(cache.stats.delivery_ns for cache in caches.values())


__all__ = ["RowCache", "RowCacheConfig", "RowCacheStats", "delivery_ns", "metrics", "open_caches"]
