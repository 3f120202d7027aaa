"""Serving until a signal, then draining: stop admitting, let open requests finish until the
drain deadline, then end the rest with an error so every stream closes cleanly, and exit.

uvicorn closes the listening socket and waits for open connections; the deadline here ends
them first, and uvicorn's own graceful-shutdown timeout is a backstop a little later, so a
stuck engine never holds the process past the deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from helios.server.state import ServerState

log = logging.getLogger("helios.server")
BACKSTOP_SECONDS = 3.0  # after the drain deadline, uvicorn cancels whatever is still running


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining and self._loop is not None:
            self._draining = True
            self.state.client.stop_admitting("the server is shutting down")
            open_requests = self.state.client.num_open
            log.warning("shutting down: %d open requests get up to %.0f s to finish", open_requests, self.drain_seconds)
            self._loop.call_soon_threadsafe(self._loop.call_later, self.drain_seconds, self._deadline)
        super().handle_exit(sig, frame)

    def _deadline(self) -> None:
        if self.state.client.num_open:
            log.warning("drain deadline passed: ending %d open requests", self.state.client.num_open)
        self.state.client.fail_open("the server is shutting down (drain deadline passed)")


class _HeaderDeadline(H11Protocol):
    """HTTP/1.1 whose request headers must be complete within `header_timeout` of the
    connection opening or of the first byte of the next request; else the connection closes.
    (uvicorn only times idle keep-alive connections, so a slow sender could hold one forever.)"""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None:
                self._arm()
        elif self._header_timer is not None:  # the request line and headers are in
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _expire(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.0f s", self.header_timeout)
            self.transport.close()


def uvicorn_config(
    app, host: str, port: int, log_level: str, drain_seconds: float, header_timeout: float
) -> uvicorn.Config:
    protocol = type("HeliosHttp", (_HeaderDeadline,), {"header_timeout": header_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=protocol,
        timeout_graceful_shutdown=int(drain_seconds + BACKSTOP_SECONDS + 0.999),
    )


def serve(app, state: ServerState, host: str, port: int, log_level: str) -> None:
    settings = state.config
    # Everything loaded so far (programs, graphs, tokenizer, templates) lives as long as the
    # server: freeze it out of the cyclic collector, whose full passes over it otherwise land
    # inside engine steps (about 5% of a long prefill here).
    gc.collect()
    gc.freeze()
    config = uvicorn_config(app, host, port, log_level, settings.drain_seconds, settings.header_timeout_seconds)
    DrainingServer(config, state, settings.drain_seconds).run()
