"""A real uvicorn server in a thread of the test process, so a test can reach into its engine
(inject a fault, kill the engine thread) while clients talk to it over a socket."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn
from serving import _free_port

from helios.config import ServerConfig
from helios.server.app import create_app
from helios.server.lifecycle import uvicorn_config
from helios.server.state import ServerState, build_state


@contextlib.contextmanager
def live_server(core: Path, config: ServerConfig) -> Iterator[tuple[str, ServerState]]:
    state = build_state(core, config)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn_config(
            create_app(state), "127.0.0.1", port, "warning", config.drain_seconds, config.header_timeout_seconds
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)  # waiting for the port to open, not for a result
    try:
        yield url, state
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        state.client.shutdown()


def wait_until(predicate, timeout: float, interval: float = 0.02) -> float:
    """Seconds until predicate() held; AssertionError past `timeout`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(interval)
    return time.monotonic() - start


def metrics(url: str) -> dict:
    return httpx.get(url + "/metrics?format=json", timeout=10).json()
