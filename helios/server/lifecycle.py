"""Serving until a signal, then draining: stop admitting, let open requests finish until the
drain deadline, then end the rest with an error so every stream closes cleanly, and exit.

uvicorn closes the listening socket and waits for open connections; the deadline here ends
them first, and uvicorn's own graceful-shutdown timeout is a backstop a little later, so a
stuck engine never holds the process past the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

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


def serve(app, state: ServerState, host: str, port: int, log_level: str, drain_seconds: float) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=int(drain_seconds + BACKSTOP_SECONDS + 0.999))  # fmt: skip
    DrainingServer(config, state, drain_seconds).run()
