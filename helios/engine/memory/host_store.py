"""The host prefix store: full KV pages of finished prefixes kept beyond the page pool, in a
DRAM tier and a disk tier that survives restarts.

A record is one full page: its chain hash (kv_cache.page_hash: the parent's hash, the
identity slot and the page's tokens), its parent hash, its tokens and the bytes of every
cache tensor's page. Records are keyed by the chain hash within one core identity (the
core's digest, KV dtype, page size and cache shapes): a store directory holds records of
exactly one identity, and every record names it again, so a record can never be restored
into a different core. Every disk record carries a checksum; a record that fails to read
or verify is deleted, counted and recomputed, never served.

Hybrid cores (recurrent state) also keep state records: the state snapshot at a page boundary,
keyed by `state_key` of the boundary's chain hash (its parent), with the same identity and
checksum rules; a hybrid prefix is restored only as far as a state record reaches.

Copy-out: when a sequence finishes, the memory manager pins its published pages (and snapshots) that
the store does not hold yet and a copier thread (host_copy.py) reads them into records and hands
them to `put`; the DRAM tier takes them at once and a writer thread writes them to disk. Lookups
run on the engine thread at admission (DRAM, else one file read per record; a reader thread
prefetches a submitted prompt's records). Each tier is bounded; the least recently used records
go first, in DRAM those of conversation anchors' chains last (while they hold at most half of it).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from helios.core import hostcache
from helios.engine.memory.kv_cache import ROOT_HASH, page_hash

log = logging.getLogger("helios.engine")

MAGIC = b"FLAREKV1"
_HEADER = struct.Struct("<8s32s16sB16sIQ")  # magic, identity, digest, parent length, parent, token count, payload bytes
_CHECK = 16


@dataclass(frozen=True, slots=True)
class Record:
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]
    payload: Tensor  # uint8, every cache tensor's page in the program's cache order (a state record: every
    # state tensor's slot in the program's order)
    anchor: bool = (
        False  # part of a conversation anchor's chain: DRAM evicts it after other records (not stored on disk)
    )

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())


class Histogram:
    """Cumulative buckets for Prometheus (upper bounds ascending; +Inf implied)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) per bucket, ending with +Inf."""
        out, total = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            total += count
            out.append(("+Inf" if bound == math.inf else f"{bound:g}", total))
        return out


_TOKEN_BUCKETS = tuple(float(1 << k) for k in range(0, 18, 2))  # 1 .. 65536 tokens
_NS_BUCKETS = tuple(10.0**k for k in range(4, 12))  # 10 us .. 100 s


@dataclass
class HostStats:
    hits: int = 0  # admissions that restored at least one page from the store
    reused_tokens: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    held: dict[str, int] = field(default_factory=lambda: {"dram": 0, "nvme": 0})  # records taken in, by tier
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # (tier, reason) -> records
    skipped: int = 0  # offered records already held or being copied: duplicates, and retries of deferred offers
    # Per admission lookup: prompt tokens it left to compute, and the estimated cost of what it
    # restored (transfer, from the measured copy-in rate) against recomputing it (from the
    # measured prefill rate); the estimates are observed once both rates are known.
    missing_tokens: Histogram = field(default_factory=lambda: Histogram(_TOKEN_BUCKETS))
    transfer_ns: Histogram = field(default_factory=lambda: Histogram(_NS_BUCKETS))
    prefill_ns: Histogram = field(default_factory=lambda: Histogram(_NS_BUCKETS))

    # Copy-out (host_copy.py): times the engine thread waited for the copier because the pool needed
    # pinned pages, and how long; records offered while the copier was behind are dropped ("dram",
    # "end_of_chain": the chain's head is kept, its end dropped).
    copy_waits: int = 0
    copy_wait_ns: int = 0
    # Copy-out offers deferred by the headroom check before pinning (CopyOut._short_of_headroom):
    # the pins would leave the pool short of what the next step may need, so the offer waits for a
    # later step boundary instead of the engine waiting for the copier.
    copy_deferrals: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def drop(self, tier: str, reason: str, count: int = 1) -> None:
        with self._lock:  # the engine, copier, writer and reader threads all drop records
            self.dropped[(tier, reason)] = self.dropped.get((tier, reason), 0) + count


def default_memory_bytes() -> int:
    """An eighth of the memory available now, at most 4 GiB (1 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            fields = dict(line.split(":", 1) for line in info)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 1 << 30
    return min(available // 8, 4 << 30)


def default_directory() -> Path:
    override = os.environ.get("FLARE_PREFIX_CACHE_DIR")
    return Path(override) if override else hostcache.directory() / "prefix"


def state_key(digest: bytes) -> bytes:
    """The key of the state record at the page boundary whose chain hash is `digest`."""
    return hashlib.blake2b(b"flare-state-v1" + digest, digest_size=16).digest()


def identity_of(core_digest: str, kv_dtype: str, page_tokens: int, cache_shapes: tuple) -> bytes:
    text = f"{core_digest}|{kv_dtype}|{page_tokens}|{cache_shapes}"
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


class HostStore:
    def __init__(self, identity: bytes, memory_bytes: int, directory: Path | None, disk_bytes: int) -> None:
        self.identity = identity
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes if directory is not None else 0
        self.directory = directory / identity.hex()[:32] if directory is not None else None
        self.stats = HostStats()
        self._lock = threading.Lock()
        self._dram: OrderedDict[bytes, Record] = OrderedDict()  # oldest first; anchors' records in _anchors
        self._anchors: OrderedDict[bytes, Record] = OrderedDict()
        self._dram_used = self._anchor_used = 0
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # digest -> file bytes, oldest first
        self._disk_used = 0
        self._writes: queue.Queue[Record | None] = queue.Queue()
        self._parked = 0  # records queued for a disk write
        self._writer: threading.Thread | None = None
        self._prefetches: queue.Queue[tuple | None] = queue.Queue(maxsize=64)
        self._reader: threading.Thread | None = None
        self._prefetching: set[str] = set()  # keys (request ids) of prefetches queued or being read
        self._prefetched = threading.Event()  # set whenever one finishes
        # Measured rates for the lookup estimates (engine-owned; 0 until measured).
        self.copy_ns_per_byte = 0.0
        self.prefill_ns_per_token = 0.0
        if self.directory is not None and self.disk_bytes > 0:
            self._open_directory()

    # ------------------------------------------------------------------ lookups (engine thread)
    def contains(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._dram or digest in self._anchors or digest in self._disk

    def fetch(self, digest: bytes, parent: bytes, tokens: tuple[int, ...]) -> Record | None:
        """The record for this page (or state record: parent the boundary's chain hash, no tokens),
        verified against what the caller expects, or None."""
        record = self.get(digest)
        if record is None or record.parent != parent or record.tokens != tokens:
            return None
        return record

    def get(self, digest: bytes) -> Record | None:
        """The record under this key from DRAM, else read from disk (checksum verified) and kept in
        DRAM; None when neither tier holds a sound one. The caller checks what the record says."""
        with self._lock:
            record = self._memory_get(digest)
            on_disk = record is None and digest in self._disk
        if record is None and on_disk:
            record = self._read(digest)
            if record is not None:
                self._keep_in_memory(record)
        return record

    def discard(self, digest: bytes) -> None:
        """Forget a record in both tiers (its caller found it unusable), so a new one can take its key."""
        with self._lock:
            for tier in (self._dram, self._anchors):
                record = tier.pop(digest, None)
                if record is not None:
                    self._dram_used -= record.nbytes
                    self._anchor_used -= record.nbytes if tier is self._anchors else 0
            size = self._disk.pop(digest, None)
            if size is not None:
                self._disk_used -= size
        if size is not None:
            try:
                self._path(digest).unlink()
            except OSError:
                pass

    def _memory_get(self, digest: bytes) -> Record | None:
        """The DRAM record, now the most recently used of its kind (lock held)."""
        for tier in (self._dram, self._anchors):
            record = tier.get(digest)
            if record is not None:
                tier.move_to_end(digest)
                return record
        return None

    def mark_anchor(self, digests: list[bytes]) -> None:
        """These held records belong to a conversation anchor's chain (evicted last from DRAM)."""
        with self._lock:
            for digest in digests:
                record = self._dram.pop(digest, None)
                if record is not None:
                    self._anchors[digest] = record
                    self._anchor_used += record.nbytes

    # ------------------------------------------------------------------ copy-out
    def put(self, records: list[Record]) -> None:
        for record in records:
            if self.contains(record.digest):
                self.stats.skipped += 1
                if record.anchor:
                    self.mark_anchor([record.digest])
                continue
            self.stats.bytes_out += record.nbytes
            self._keep_in_memory(record)
            if self._writer is not None:
                with self._lock:
                    self._parked += 1
                self._writes.put(record)

    def _keep_in_memory(self, record: Record) -> None:
        if record.nbytes > self.memory_bytes:
            self.stats.drop("dram", "oversize")
            return
        with self._lock:
            if record.digest in self._dram or record.digest in self._anchors:
                return
            (self._anchors if record.anchor else self._dram)[record.digest] = record
            self._dram_used += record.nbytes
            self._anchor_used += record.nbytes if record.anchor else 0
            self.stats.held["dram"] += 1
            while self._dram_used > self.memory_bytes:
                # Anchors' records go last while they hold at most half of the tier.
                from_anchors = not self._dram or (self._anchor_used > self.memory_bytes // 2 and bool(self._anchors))
                _, old = (self._anchors if from_anchors else self._dram).popitem(last=False)
                self._dram_used -= old.nbytes
                if from_anchors:
                    self._anchor_used -= old.nbytes
                self.stats.drop("dram", "end_of_chain")

    # ------------------------------------------------------------------ the disk tier
    def _open_directory(self) -> None:
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            files = sorted(self.directory.glob("*.rec"), key=lambda p: p.stat().st_mtime)
        except OSError as exc:
            log.warning("host prefix store: the disk tier is off (%s: %s)", self.directory, exc.strerror)
            self.disk_bytes = 0
            return
        for path in files:
            try:
                digest = bytes.fromhex(path.stem)
                size = path.stat().st_size
            except (ValueError, OSError):
                continue
            self._disk[digest] = size
            self._disk_used += size
        self._trim_disk()
        self._writer = threading.Thread(target=self._write_loop, name="helios-host-store", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._prefetch_loop, name="helios-host-prefetch", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ prefetch (off the engine thread)
    def prefetch(
        self, tokens: tuple[int, ...], identity, page_tokens: int, states: bool = False, key: str | None = None
    ) -> None:
        """Bring this prompt's chain of disk records (and with `states`, the state records at its
        page boundaries) into memory before admission looks them up (best effort: a full queue
        drops the hint; admission then reads what it still needs). `identity`: one slot for every
        page, or page index -> its slot (EngineRequest.page_identity). With a `key`,
        `prefetching(key)` is true until the reader is done with it, so admission can wait for
        the records instead of reading them on the engine thread."""
        if self._reader is None or len(tokens) <= page_tokens:
            return
        if key is not None:
            with self._lock:
                self._prefetching.add(key)
        try:
            self._prefetches.put_nowait((tuple(tokens), identity, page_tokens, states, key))
        except queue.Full:
            self._done_prefetching(key)

    def prefetching(self, key: str) -> bool:
        """Whether the reader still has this key's records to bring in (false once it stopped)."""
        reader = self._reader
        with self._lock:
            return key in self._prefetching and reader is not None and reader.is_alive()

    def wait_prefetch(self, timeout: float) -> None:
        """Block until some prefetch finishes, or `timeout` seconds (the engine, with nothing else to do)."""
        self._prefetched.wait(timeout)
        self._prefetched.clear()

    def _done_prefetching(self, key: str | None) -> None:
        if key is not None:
            with self._lock:
                self._prefetching.discard(key)
        self._prefetched.set()

    def _prefetch_loop(self) -> None:
        while True:
            item = self._prefetches.get()
            if item is None:
                return
            tokens, identity, size, states, key = item
            try:
                slot = identity if callable(identity) else (lambda index, fixed=identity: fixed)
                parent = ROOT_HASH
                for index in range((len(tokens) - 1) // size):
                    digest = page_hash(parent, slot(index), tokens[index * size : (index + 1) * size])
                    if not self._bring(digest):
                        break
                    if states:
                        self._bring(state_key(digest))
                    parent = digest
            except Exception as exc:  # noqa: BLE001 - a hint: admission reads what it still needs
                log.warning("host prefix store: prefetch failed (%s: %s)", type(exc).__name__, exc)
            finally:
                self._done_prefetching(key)

    def _bring(self, digest: bytes) -> bool:
        """Whether the record is in memory now (read from disk if needed)."""
        with self._lock:
            in_memory, on_disk = digest in self._dram or digest in self._anchors, digest in self._disk
        if in_memory:
            return True
        record = self._read(digest) if on_disk else None
        if record is not None:
            self._keep_in_memory(record)
        return record is not None

    def _path(self, digest: bytes) -> Path:
        assert self.directory is not None
        return self.directory / f"{digest.hex()}.rec"

    def _write_loop(self) -> None:
        while True:
            record = self._writes.get()
            if record is None:
                return
            try:
                self._write(record)
            except OSError as exc:
                self.stats.drop("nvme", "io_error")
                log.warning("host prefix store: a record write failed (%s)", exc.strerror)
            finally:
                with self._lock:
                    self._parked -= 1
                self._writes.task_done()

    def _write(self, record: Record) -> None:
        size = _HEADER.size + 4 * len(record.tokens) + record.nbytes + _CHECK
        if size > self.disk_bytes:
            self.stats.drop("nvme", "oversize")
            return
        header = _HEADER.pack(
            MAGIC, self.identity, record.digest, len(record.parent), record.parent, len(record.tokens), record.nbytes
        )
        body = struct.pack(f"<{len(record.tokens)}i", *record.tokens)
        payload = record.payload.numpy().tobytes()
        check = hashlib.blake2b(header + body + payload, digest_size=_CHECK).digest()
        path = self._path(record.digest)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as out:
            out.write(header + body + payload + check)
        os.replace(temporary, path)
        with self._lock:
            if record.digest not in self._disk:
                self._disk[record.digest] = size
                self._disk_used += size
                self.stats.held["nvme"] += 1
            self._trim_disk()

    def _trim_disk(self) -> None:
        """Drop the oldest files past the disk budget (lock held, or before the writer starts)."""
        while self._disk_used > self.disk_bytes and self._disk:
            digest, size = self._disk.popitem(last=False)
            self._disk_used -= size
            self.stats.drop("nvme", "end_of_chain")
            try:
                self._path(digest).unlink()
            except OSError:
                pass

    def _read(self, digest: bytes) -> Record | None:
        path = self._path(digest)
        try:
            data = path.read_bytes()
            magic, identity, stored, parent_length, parent, count, nbytes = _HEADER.unpack_from(data)
            parent = parent[:parent_length]
            body_end = _HEADER.size + 4 * count
            if (
                magic != MAGIC
                or identity != self.identity
                or stored != digest
                or len(data) != body_end + nbytes + _CHECK
            ):
                raise ValueError("a record of another core, or truncated")
            if hashlib.blake2b(data[:-_CHECK], digest_size=_CHECK).digest() != data[-_CHECK:]:
                raise ValueError("checksum mismatch")
            tokens = struct.unpack_from(f"<{count}i", data, _HEADER.size)
            payload = torch.frombuffer(bytearray(data[body_end : body_end + nbytes]), dtype=torch.uint8)
        except (OSError, ValueError, struct.error) as exc:
            log.warning("host prefix store: dropping record %s (%s)", path.name, exc)
            self.stats.drop("nvme", "io_error")
            with self._lock:
                size = self._disk.pop(digest, None)
                if size is not None:
                    self._disk_used -= size
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return Record(digest, parent, tuple(tokens), payload)

    # ------------------------------------------------------------------ gauges and shutdown
    @property
    def memory_records(self) -> int:
        return len(self._dram) + len(self._anchors)

    @property
    def anchor_records(self) -> int:
        """DRAM records of conversation anchors' chains."""
        return len(self._anchors)

    @property
    def disk_records(self) -> int:
        return len(self._disk)

    @property
    def parked_records(self) -> int:
        return self._parked

    def clear(self) -> int:
        """Forget every record in both tiers and delete this store's record files (POST /flush_cache);
        queued disk writes finish first. Returns the count of records dropped."""
        self.flush()
        with self._lock:
            dropped = len(self._dram) + len(self._anchors) + len(self._disk)
            self._dram.clear()
            self._anchors.clear()
            self._dram_used = self._anchor_used = 0
            files, self._disk = list(self._disk), OrderedDict()
            self._disk_used = 0
        for digest in files:
            try:
                self._path(digest).unlink()
            except OSError:
                pass
        return dropped

    def flush(self) -> None:
        """Wait for queued disk writes (tests, shutdown)."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=10)
            self._writer = None
        if self._reader is not None:
            try:
                self._prefetches.put(None, timeout=1)
            except queue.Full:
                pass
            self._reader = None
