"""The host store's copy-out worker: reads pinned KV pages and state snapshots into records off
the engine thread.

The memory manager pins what it offers (a pool reference on each page, a pin on each snapshot slot),
so no later step can overwrite it while this thread reads it; the engine hands a step's offers
over at the step's end and releases the pins of finished jobs at its next step boundary
(`take_done`). No lock is held across a step: the handoff is a queue, the results a deque.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.engine.memory.host_store import HostStore, Record

log = logging.getLogger("helios.engine")


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One record to copy out of a pinned page or snapshot slot."""

    state: bool  # False: a KV page (index is a pool page); True: a state snapshot (index is its slot)
    index: int  # pinned by the memory manager until the engine takes this job back from take_done
    digest: bytes  # the record's key: the page's chain hash, or host_store.state_key of the boundary's
    parent: bytes  # the previous page's chain hash; for a state record, the boundary's chain hash
    tokens: tuple[int, ...]  # the page's tokens (() for a state record)
    anchor: bool = False  # the record belongs to a conversation anchor's chain (evicted last from DRAM)

    @property
    def key(self) -> tuple[bool, int]:
        return self.state, self.index


class Copier:
    def __init__(self, store: HostStore, pages: list[Tensor], states: list[Tensor]) -> None:
        self.store = store
        self._pages = _Source(pages)  # [num_pages, ...] each: the paged caches in the program's order
        self._states = _Source(states)  # [num_slots, ...] each: recurrent-state tensors (hybrid cores)
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in pages)
        self.state_bytes = sum(t[0].numel() * t.element_size() for t in states)
        self._jobs: queue.SimpleQueue[list[CopyJob] | None] = queue.SimpleQueue()
        self._done: deque[CopyJob] = deque()
        self._lock = threading.Condition()
        self._outstanding = 0  # jobs submitted and not yet in _done
        self.on_done: Callable[[], None] | None = None  # wakes an idle engine loop to release the pins
        self.worker_ns = 0  # time this thread spent copying (and taking records into the store)
        self._thread = threading.Thread(target=self._loop, name="helios-host-copier", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def submit(self, jobs: list[CopyJob]) -> None:
        if jobs:
            with self._lock:
                self._outstanding += len(jobs)
            self._jobs.put(list(jobs))

    def take_done(self) -> list[CopyJob]:
        """Jobs finished since the last call (their pins may be released now)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def wait(self) -> None:
        """Until every submitted job is done (pool pressure, flush, shutdown)."""
        with self._lock:
            self._lock.wait_for(lambda: self._outstanding == 0)

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        while True:
            jobs = self._jobs.get()
            if jobs is None:
                return
            for job in jobs:
                started = time.perf_counter_ns()
                try:
                    payload = (self._states if job.state else self._pages).gather(job.index)
                    self.store.put([Record(job.digest, job.parent, job.tokens, payload, job.anchor)])
                except Exception as exc:  # noqa: BLE001 - a failed copy loses one record, never the engine
                    log.warning("host prefix store: a copy-out failed (%s: %s)", type(exc).__name__, exc)
                    self.store.stats.drop("dram", "io_error")
                self.worker_ns += time.perf_counter_ns() - started
                with self._lock:
                    self._done.append(job)
                    self._outstanding -= 1
                    self._lock.notify_all()
            if self.on_done is not None:
                self.on_done()


class _Source:
    """Cache tensors a record gathers one row (a page, a slot) of each from. CPU tensors are read
    through numpy views made once: a record is one numpy copy per tensor (one thread, the GIL
    released), so the copier neither competes with the step for torch's intra-op threads nor
    holds the GIL for long between copies."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors
        self.widths = [t[0].numel() * t.element_size() for t in tensors]
        self.views = [
            t.view(torch.uint8).numpy().reshape(t.shape[0], -1)
            if t.device.type == "cpu" and t.is_contiguous()
            else None
            for t in tensors
        ]

    def gather(self, index: int) -> Tensor:
        return _gather(self, index)


def _gather(source: _Source, index: int) -> Tensor:
    """Row `index` of every tensor's bytes, concatenated in order, in one new uint8 CPU tensor."""
    out = torch.empty(sum(source.widths), dtype=torch.uint8)
    target = out.numpy()
    offset = 0
    for tensor, view, width in zip(source.tensors, source.views, source.widths):
        if view is not None:
            target[offset : offset + width] = view[index]
        else:
            out[offset : offset + width].copy_(tensor[index].contiguous().reshape(-1).view(torch.uint8))
        offset += width
    return out
