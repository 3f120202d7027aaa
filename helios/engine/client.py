"""EngineClient: the asyncio-facing side of the engine, which runs in its own thread.

`submit()` validates and enqueues synchronously (so callers can answer 400/503 before
streaming), then returns an async iterator of the request's events. Leaving the
iterator early aborts the request; its pages are freed after the step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from helios.core.logs import log_failure
from helios.engine.engine import LLMEngine
from helios.engine.metrics import CacheFlush, EngineMetrics
from helios.engine.request import EngineEvent, EngineRequest, FinishCause

log = logging.getLogger("helios.engine")


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the context or the pool)."""


class QueueFull(RuntimeError):
    """The pending queue is full; try again later."""


class EngineUnavailable(RuntimeError):
    """The engine thread has stopped."""


class FlushRefused(RuntimeError):
    """A prefix-cache flush asked for while requests are open: nothing was dropped."""


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # choices the consumer has not seen finish
    open: set[int]  # choices the engine has not finished
    done: bool = False  # the consumer saw every choice finish


class EngineClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[EngineRequest] = []
        self._aborts: list[tuple[str, int | None]] = []
        self._flushes: list[Future[CacheFlush]] = []  # flush_prefix_cache calls the engine thread has not run
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._refusal: str | None = None  # set while draining: why new requests are refused
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="helios-engine", daemon=True)
        engine.on_copied(self._wake.set)  # finished host-store copies: release their pins when idle

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineClient:
        self._thread.start()
        return self

    def stop_admitting(self, reason: str) -> None:
        """Refuse new requests (503) from now on; open ones continue."""
        self._refusal = reason

    def fail_open(self, reason: str) -> None:
        """End every open request now with an error, whatever the engine thread is doing."""
        with self._lock:
            streams, self._streams = self._streams, {}
            self._inbox = []
            self._aborts += [(request_id, None) for request_id in streams]
        self._wake.set()
        _fail_streams(streams, reason)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; requests still open end with an error."""
        self.stop_admitting("the server is shutting down")
        self.fail_open("the server is shutting down")
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.engine.close()  # the host store's queued disk writes

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def refusal(self) -> str | None:
        """Why new requests are refused while the engine still runs (draining after stop_admitting), or None."""
        return self._refusal

    def metrics(self) -> EngineMetrics:
        """The engine's counters and gauges now (any thread; read racily from the engine thread's)."""
        return self.engine.metrics()

    @property
    def num_open(self) -> int:
        """Requests submitted and not finished by the engine."""
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    def submit(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        return self.submit_group((request,))[0]

    def submit_group(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[EngineEvent]]:
        """Submit a group all or nothing (a batch's children): every request is checked, and the
        queue bound applies to the whole group, before any of them is queued."""
        self._check_available()
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise RequestRejected("a submitted group repeats a request id")
        for request in requests:
            reason = self.engine.check(request)
            if reason is not None:
                raise RequestRejected(reason)
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop, asyncio.Queue(), r.n, set(range(r.n))) for r in requests]
        # Before the engine can see them: admission then waits for the host store to read the
        # prompts' disk records on its own thread instead of reading them on the engine's.
        for request in requests:
            self.engine.prefetch(request)
        with self._lock:
            self._check_available()
            for request_id in ids:
                if request_id in self._streams:
                    raise RequestRejected(f"request id {request_id!r} is already in flight")
            if len(self._inbox) + self.engine.stats.pending + len(requests) > self.engine.config.max_pending:
                raise QueueFull("the model request queue is full")
            for request, stream in zip(requests, streams, strict=True):
                self._streams[request.request_id] = stream
                self._inbox.append(request)
        self._wake.set()
        return [self._events(r.request_id, stream) for r, stream in zip(requests, streams, strict=True)]

    def _check_available(self) -> None:
        if not self.healthy:
            raise EngineUnavailable(self.failure or "the engine is not running")
        if self._refusal is not None:
            raise EngineUnavailable(self._refusal)

    def flush_prefix_cache(self) -> Future[CacheFlush]:
        """Drop every cached prefix (GPU pages, state snapshots, host store) on the engine thread
        between steps. The future fails with FlushRefused while any request is open (submitted and
        not finished), and with EngineUnavailable when the engine has stopped."""
        future: Future[CacheFlush] = Future()
        with self._lock:
            if not self.healthy:
                future.set_exception(EngineUnavailable(self.failure or "the engine is not running"))
                return future
            self._flushes.append(future)
        self._wake.set()
        return future

    def abort(self, request_id: str, choice_index: int | None = None) -> None:
        with self._lock:
            self._aborts.append((request_id, choice_index))
        self._wake.set()

    async def _events(self, request_id: str, stream: _Stream) -> AsyncIterator[EngineEvent]:
        try:
            while stream.remaining:
                event = await stream.queue.get()
                if event.finish is not None:
                    stream.remaining -= 1
                yield event
            stream.done = True
        finally:
            if not stream.done:
                self.abort(request_id)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    flushes, self._flushes = self._flushes, []
                for request in inbox:
                    self.engine.add(request)
                for request_id, choice_index in aborts:
                    self.engine.abort(request_id, choice_index)
                for future in flushes:
                    self._flush(future)
                if not self.engine.has_work:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - report, fail every open request, refuse new work
            log_failure(log, "engine thread died", exc)
            self.failure = f"the engine stopped: {type(exc).__name__}: {exc}"
            self.fail_open(self.failure)
        with self._lock:  # stopped or failed: flushes asked for now have no thread to run them
            flushes, self._flushes = self._flushes, []
        for future in flushes:
            future.set_exception(EngineUnavailable(self.failure or "the engine has stopped"))

    def _flush(self, future: Future[CacheFlush]) -> None:
        open_requests = self.num_open
        flushed = self.engine.flush_prefix_cache() if not open_requests else None
        if flushed is None:
            future.set_exception(
                FlushRefused(f"{open_requests or 'some'} requests are open: flush the cache when none runs")
            )
        else:
            future.set_result(flushed)

    def _deliver(self, events: list[EngineEvent]) -> None:
        # One wake-up per event loop per step, not one per event: each wake-up is a
        # self-pipe write and a loop iteration contending for the GIL with this thread.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineEvent]]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:
                    continue
                batches.setdefault(stream.loop, []).append((stream.queue, event))
                if event.finish is not None:
                    stream.open.discard(event.choice_index)
                    if not stream.open:  # the engine is done with it
                        del self._streams[event.request_id]
        _post(batches)


def _fail_streams(streams: dict[str, _Stream], reason: str) -> None:
    """An error finish for every choice the engine has not finished."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineEvent]]] = {}
    for request_id, stream in streams.items():
        for index in sorted(stream.open):
            event = EngineEvent(request_id, index, (), None, FinishCause.ERROR, error=reason)
            batches.setdefault(stream.loop, []).append((stream.queue, event))
        stream.open.clear()
    _post(batches)


def _post(batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineEvent]]]) -> None:
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop has closed (server shutting down)
            log.debug("dropped %d events for a closed event loop", len(batch))


def _put_all(batch: list[tuple[asyncio.Queue, EngineEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
