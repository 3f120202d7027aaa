"""The `helios top` loop: sample GET /metrics?format=json, keep the history, redraw.

On a terminal it is a rich Live screen that reads single keys (termios cbreak mode, restored
on exit, so it works over SSH); without one it prints a plain block per interval. A server
that stops answering is shown in the dashboard, never a crash.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from helios.top.view import ASCII_BLOCKS, BLOCKS, History, Snapshot, Status, dashboard, plain

FETCH_TIMEOUT = 5.0  # seconds; a server slower than this to report counters counts as unreachable


class Unreachable(Exception):
    """The metrics could not be read; the message says why, naming the address."""


def metrics_url(url: str) -> str:
    """The JSON metrics address of a server given as http://host:port, host:port or its /v1 base URL."""
    base = url.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    for suffix in ("/metrics", "/v1"):
        base = base.removesuffix(suffix)
    return base + "/metrics?format=json"


def fetch(url: str, timeout: float = FETCH_TIMEOUT) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise Unreachable(f"{url} answered HTTP {exc.code} (is this a helios server?)") from None
    except urllib.error.URLError as exc:
        raise Unreachable(f"cannot reach {url}: {exc.reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets; ValueError: a malformed address
        raise Unreachable(f"cannot reach {url}: {exc}") from None
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise Unreachable(f"{url} did not answer a JSON object (is this a helios server?)")
    return value


class Sampler:
    """The last two answers, the time between them, and the plots' history."""

    def __init__(
        self,
        url: str,
        interval: float,
        fetcher: Callable[[str], dict[str, Any]] = fetch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.fetcher, self.clock = metrics_url(url), fetcher, clock
        self.status = Status(url=self.source.removesuffix("/metrics?format=json"), interval=interval)
        self.prev: Snapshot | None = None
        self.cur: Snapshot | None = None
        self.elapsed = 0.0
        self.history = History()
        self._taken = 0.0

    def sample(self) -> bool:
        """Fetch once; False (and the error in the status) when the server did not answer."""
        try:
            answer = self.fetcher(self.source)
        except Unreachable as exc:
            self.status = replace(self.status, fetch_errors=self.status.fetch_errors + 1, last_error=str(exc))
            return False
        now = self.clock()
        elapsed = now - self._taken if self.cur is not None else 0.0
        self.prev, self.cur, self.elapsed, self._taken = self.cur, answer, elapsed, now
        self.history.record(self.prev, self.cur, self.elapsed)
        self.status = replace(self.status, last_error=None)
        return True

    def inputs(self) -> tuple[Snapshot | None, Snapshot, float, History]:
        return self.prev, self.cur or {}, self.elapsed, self.history


def run(url: str, interval: float, once: bool) -> int:
    """The command's exit status: 0, or 1 when --once could not read the server."""
    sampler = Sampler(url, interval)
    if once:
        return _once(sampler, interval)
    try:
        if sys.stdout.isatty():
            _live(sampler, interval)
        else:
            _periodic(sampler, interval, sys.stdout)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `helios top | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter flushes stdout at exit
    return 0


def _blocks(stream: TextIO) -> str:
    try:
        BLOCKS.encode(stream.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ASCII_BLOCKS
    return BLOCKS


def _once(sampler: Sampler, interval: float) -> int:
    """Two samples one interval apart (so rates exist), one plain snapshot."""
    for attempt in range(2):
        if attempt:
            time.sleep(interval)
        if not sampler.sample():
            print(f"error: {sampler.status.last_error}", file=sys.stderr)
            return 1
    sys.stdout.write(plain(*sampler.inputs(), sampler.status, blocks=_blocks(sys.stdout)))
    return 0


def _next_tick(previous: float, interval: float) -> float:
    """One interval after the previous tick, or after now when a slow fetch overran it (no catching up)."""
    now = time.monotonic()
    return previous + interval if previous + interval > now else now + interval


def _periodic(sampler: Sampler, interval: float, out: TextIO) -> None:
    """No terminal: one plain block per interval, separated by a line with the time."""
    blocks, tick = _blocks(out), time.monotonic()
    while True:
        sampler.sample()
        out.write(f"--- {time.strftime('%H:%M:%S')} ---\n")
        if sampler.cur is None:
            out.write(f"error: {sampler.status.last_error}\n\n")
        else:
            out.write(plain(*sampler.inputs(), sampler.status, blocks=blocks) + "\n")
        out.flush()
        tick = _next_tick(tick, interval)
        time.sleep(max(0.0, tick - time.monotonic()))


def _honour_ctrl_c() -> None:
    """Ctrl-C quits the dashboard even when the process was started with SIGINT ignored or
    blocked (both are inherited from the parent that started it): take Python's own handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _live(sampler: Sampler, interval: float) -> None:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console()
    paused = False
    frozen = None  # what the screen shows while paused: (prev, cur, elapsed, history copy)

    def view():
        if sampler.cur is None:  # never reached yet
            return Text(f"helios top {sampler.status.url}\n\n{sampler.status.last_error or 'connecting ...'}")
        status = replace(sampler.status, paused=paused, interactive=keys.enabled)
        return dashboard(*(frozen if paused and frozen else sampler.inputs()), status)

    _honour_ctrl_c()
    with Keys() as keys, Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False) as live:
        tick = time.monotonic()
        while True:
            sampler.sample()
            live.update(view(), refresh=True)
            tick = _next_tick(tick, interval)
            while (left := tick - time.monotonic()) > 0:
                pressed = keys.read(left)
                if any(key in "qQ" for key in pressed):
                    return
                if any(key in "pP " for key in pressed):
                    paused = not paused
                    frozen = (sampler.prev, sampler.cur, sampler.elapsed, sampler.history.copy()) if paused else None
                    live.update(view(), refresh=True)


class Keys:
    """Single key presses from the controlling terminal in cbreak mode (no Enter, Ctrl-C still
    interrupts), restored on exit; without a terminal on stdin, read() only waits."""

    def __init__(self) -> None:
        self.enabled = False
        self._saved: list[Any] | None = None

    def __enter__(self) -> Keys:
        if sys.stdin.isatty():
            import termios
            import tty

            self._fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
            self.enabled = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str:
        """Keys pressed within `timeout` seconds ("" when none)."""
        if not self.enabled:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self._fd], [], [], timeout)
        return os.read(self._fd, 64).decode(errors="ignore") if ready else ""
