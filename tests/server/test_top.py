"""helios top: the dashboard drawn from recorded /metrics snapshots (no server), and the command
against a real server under load (--once, plain periodic output, a pseudo-terminal with keys)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from serving import ROOT, Server, _free_port, start_server, stop_server
from support import run_cli

from helios.server.metrics import json_snapshot
from helios.top import History, Sampler, Status, Unreachable, dashboard, metrics_url, plain, spark

DATA = Path(__file__).resolve().parents[1] / "data" / "top"
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>78])")

# busy_prev.json -> busy_cur.json over 2 s: the value each label must show.
BUSY = {
    "active": "3",
    "pending": "2",
    "completed": "44 (2.0/s)",
    "preemptions": "1 (0.5/s)",
    "HTTP slots": "5 of 512 in use",
    "tokens/s in": "300.0 (peak 300.0)",
    "tokens/s out": "250.0 (peak 250.0)",
    "WEIGHTS": "27.00 GB/s (100.0 steps/s x 257.5 MiB)",  # 270 MB x 200 verify steps / 2 s
    "TTFT median": "125 ms",
    "TTFT samples": "37 in the last 60 s",
    "free": "5,000",
    "cached": "2,000",
    "used": "1,192 (14.6%)",
    "total": "8,192 (16 tokens each)",
    "prefix reuse": "40.0% (400 of 1,000 tokens)",  # 400 reused / (600 prefilled + 400 reused)
    "DEPTH": "2.50 (250 drafts / 100 rounds)",
    "acceptance": "60.0% (150 of 250)",
    "drafted rounds": "80.0%",
    "drafter": "prompt and output history",
    "memory records": "120",
    "disk records": "300",
    "parked for disk": "2",
    "hits": "14 (2.0/s)",
    "reused tokens": "5,512 (256.0/s)",
    "bytes in": "3.0 MiB (1.0 MiB/s)",
    "bytes out": "14.0 MiB (2.0 MiB/s)",
    "held (total)": "dram 120, nvme 300",
    "dropped (total)": "dram/oversize 1, nvme/io_error 2",
    "failed": "3 (1.0/s)",
    "connection": "ok",
}
TITLES = ("Requests", "Tokens", "First response", "KV pages", "Speculation", "Host cache", "Errors")
# Every row a llama core shows under load (a hybrid core adds the state-slot rows instead of speculation).
LIVE_LABELS = tuple(BUSY)


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def drawn(renderable: object, width: int) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def rows(text: str) -> dict[str, str]:
    """label -> value of a plain snapshot's indented rows."""
    found = {}
    for line in text.splitlines():
        if line.startswith("  "):
            label, _, value = line.strip().partition("  ")
            found[label] = value.strip()
    return found


# ---------------------------------------------------------------------------- recorded snapshots
def test_plain_snapshot_shows_every_field_with_its_computed_value() -> None:
    history = History(tokens_in=[0, 150, 300], tokens_out=[100, 200, 250])
    text = plain(load("busy_prev"), load("busy_cur"), 2.0, history, Status(url="http://127.0.0.1:8000"))
    shown = rows(text)
    for label, value in BUSY.items():
        assert shown[label].startswith(value), (label, shown[label])
    assert shown["tokens/s in"].endswith("[ \u2584\u2588]")  # 0, half of the peak, the peak
    assert text.splitlines()[0] == "helios top http://127.0.0.1:8000 | up 1h02m05s | every 1 s"
    assert [line for line in text.splitlines() if not line.startswith(" ")][1:] == list(TITLES)
    assert "State slots" not in text


@pytest.mark.parametrize("width", [80, 120, 200])
def test_dashboard_shows_every_field_at_any_width(width: int) -> None:
    history = History(tokens_in=[0, 150, 300], tokens_out=[100, 200, 250])
    status = Status(url="http://127.0.0.1:8000", interactive=True)
    text = drawn(dashboard(load("busy_prev"), load("busy_cur"), 2.0, history, status), width)
    for title in TITLES:
        assert title in text
    for label, value in BUSY.items():
        assert re.search(rf"{re.escape(label)} +{re.escape(value)}", text), (label, value)
    assert "p pause, q quit" in text and "PAUSED" not in text
    assert "\u2584\u2588" in text  # the tokens/s in plot


def test_wide_dashboard_puts_panels_side_by_side() -> None:
    text = drawn(dashboard(load("busy_prev"), load("busy_cur"), 2.0, History()), 160)
    assert any("Requests" in line and "First response" in line for line in text.splitlines())


def test_hybrid_core_shows_state_slots_and_no_speculation_or_host_cache() -> None:
    text = plain(load("hybrid_prev"), load("hybrid_cur"), 1.0, History())
    shown = rows(text)
    assert shown["slots used"] == "3 of 16" and shown["snapshots"] == "5" and shown["slot size"] == "1.5 MiB"
    assert shown["WEIGHTS"] == "- (the core declares no decode_weight_bytes)"
    assert shown["TTFT median"] == "1.50 s" and "truncated" in shown["TTFT samples"]
    assert shown["prefix reuse"] == "33.3% (1,024 of 3,072 tokens)"
    assert "Speculation" not in text and "Host cache" not in text and "DEPTH" not in text
    assert "State slots" in drawn(dashboard(load("hybrid_prev"), load("hybrid_cur"), 1.0, History()), 120)


@pytest.mark.parametrize("snapshot", [{}, json_snapshot({}, {})], ids=["absent", "zero"])
def test_empty_snapshot_renders_dashes_not_errors(snapshot: dict) -> None:
    for prev, elapsed in ((None, 0.0), (snapshot, 1.0)):
        text = plain(prev, snapshot, elapsed, History())
        shown = rows(text)
        assert shown["active"] == "0" and shown["used"] == "0 (-)" and shown["TTFT median"] == "-"
        assert shown["prefix reuse"] == "-" and shown["connection"] == "ok"
        for absent in ("Speculation", "Host cache", "State slots"):
            assert absent not in text
        assert "KV pages" in drawn(dashboard(prev, snapshot, elapsed, History()), 100)
    assert rows(plain(None, snapshot, 0.0, History()))["tokens/s out"] == "-"
    assert rows(plain(snapshot, snapshot, 1.0, History()))["tokens/s out"] == "0.0"


def test_idle_interval_and_restarted_server_show_no_ratios() -> None:
    busy = load("busy_cur")
    idle = rows(plain(busy, busy, 1.0, History()))
    assert idle["DEPTH"] == "-" and idle["acceptance"] == "-" and idle["prefix reuse"] == "-"
    assert idle["WEIGHTS"].startswith("0.00 GB/s") and idle["completed"] == "44 (0.0/s)"
    restarted = rows(plain(busy, load("busy_prev"), 1.0, History()))  # every counter went back
    assert restarted["completed"] == "40 (-)" and restarted["DEPTH"] == "-"
    grown_since = dict(busy, completed=50, uptime_seconds=3)  # restarted, and already past the old count
    assert rows(plain(busy, grown_since, 1.0, History()))["completed"] == "50 (-)"


def test_spark_scales_to_the_peak_of_what_it_shows() -> None:
    assert spark([0, 1, 2, 4, 8], 5) == " \u2581\u2582\u2584\u2588"
    assert spark([100, 0, 8], 2) == " \u2588"  # the 100 scrolled out
    assert spark([0, 0], 4) == "  " and spark([], 4) == ""


def test_sampler_shows_the_last_answer_while_the_server_is_unreachable() -> None:
    busy_prev, busy_cur = load("busy_prev"), load("busy_cur")
    answers: list[Any] = [busy_prev, Unreachable("cannot reach http://x/metrics?format=json: refused"), busy_cur]
    times = iter([10.0, 12.0])

    def fetcher(url: str) -> dict:
        assert url == "http://x/metrics?format=json"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    sampler = Sampler("http://x/v1", 1.0, fetcher, clock=lambda: next(times))
    assert sampler.sample() and not sampler.sample()
    down = drawn(dashboard(*sampler.inputs(), sampler.status), 120)
    assert "UNREACHABLE" in down and "error: cannot reach http://x/metrics?format=json: refused" in down
    assert "unreachable (1 failed fetches)" in down and re.search(r"active +4 ", down)  # busy_prev still shown
    assert sampler.sample() and sampler.elapsed == 2.0
    back = rows(plain(*sampler.inputs(), sampler.status))
    assert back["DEPTH"].startswith("2.50") and back["connection"] == "ok (1 failed fetches earlier)"


@pytest.mark.parametrize("given", ["http://h:1", "http://h:1/", "h:1", "http://h:1/v1", "http://h:1/metrics"])
def test_metrics_url_accepts_the_forms_users_copy(given: str) -> None:
    assert metrics_url(given) == "http://h:1/metrics?format=json"


# ---------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def loaded_server(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny core (adaptive speculation and the host store on, as by default) with four clients
    sending repetitive completions until the module's tests are done. speculative_rows is set:
    measured on a busy host it can come out below four rows, and then no drafts are offered."""
    server = start_server(tiny_core, tmp_path_factory.mktemp("top"), max_concurrency=8, speculative_rows=16)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                http.post(
                    server.url + "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "one two three one two three one two three",
                        "max_tokens": 48,
                        "temperature": 0,
                    },
                )

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # until every section has something to show: drafts offered, records held
            snapshot = server.metrics()
            if snapshot["verification_drafts"] and snapshot["host_cache_held"] and snapshot["completed"] >= 4:
                break
            assert time.monotonic() < deadline, f"no drafts or host records under load: {snapshot}"
            time.sleep(0.1)  # polling the server's state, not waiting for a result
        yield server
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        stop_server(server)


def test_once_prints_every_field_of_a_loaded_server(loaded_server: Server) -> None:
    done = run_cli("helios", "top", loaded_server.url, "--once", "--interval", "0.5")
    assert done.returncode == 0, done.stderr
    assert not ANSI.search(done.stdout)  # plain text, not a terminal's
    shown = rows(done.stdout)
    assert set(LIVE_LABELS) <= set(shown), set(LIVE_LABELS) - set(shown)
    assert done.stdout.startswith(f"helios top {loaded_server.url} | up ")
    assert float(shown["tokens/s out"].split()[0].replace(",", "")) > 0  # the clients were generating
    assert re.fullmatch(r"\d+\.\d\d GB/s \([\d,.]+ steps/s x [\d,.]+ [KMG]?i?B\)", shown["WEIGHTS"]), shown["WEIGHTS"]
    assert shown["TTFT median"].endswith(("ms", " s")) and shown["connection"] == "ok"
    assert re.fullmatch(r"dram \d+(, nvme \d+)?", shown["held (total)"])


def test_without_a_terminal_it_prints_a_plain_block_per_interval(loaded_server: Server) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "helios", "top", loaded_server.url, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    output = b""
    try:
        deadline = time.monotonic() + 60
        while output.count(b"\nErrors\n") < 3:
            assert time.monotonic() < deadline and process.poll() is None, output.decode()
            if select.select([process.stdout], [], [], 1)[0]:
                output += os.read(process.stdout.fileno(), 65536)  # type: ignore[union-attr]
    finally:
        process.terminate()
        process.wait(timeout=20)
    text = output.decode()
    blocks = [block for block in re.split(r"^--- \d\d:\d\d:\d\d ---\n", text, flags=re.M) if block.strip()]
    assert len(blocks) >= 3 and not ANSI.search(text)
    later = rows(blocks[2])
    assert set(LIVE_LABELS) <= set(later) and later["tokens/s out"] != "-"


def test_help_lists_top_and_its_options() -> None:
    from typer.testing import CliRunner

    from helios.cli import app

    listed = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "top " in listed.output and "A live terminal dashboard" in listed.output
    shown = CliRunner().invoke(app, ["top", "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "[default: http://127.0.0.1:8000]" in shown.output
    for option in ("URL", "--interval", "--once", "p or space pauses"):
        assert option in shown.output


def test_unreachable_server_exits_1_with_a_message() -> None:
    port = _free_port()
    done = run_cli("helios", "top", f"127.0.0.1:{port}", "--once", "--interval", "0.1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"error: cannot reach http://127.0.0.1:{port}/metrics?format=json: ")


def _read_until(master: int, process: subprocess.Popen, text: str, seen: list[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in ANSI.sub("", "".join(seen)):
        assert time.monotonic() < deadline and process.poll() is None, ANSI.sub("", "".join(seen))[-2000:]
        if select.select([master], [], [], 1)[0]:
            seen.append(os.read(master, 65536).decode(errors="replace"))


def _signal_state(pid: int) -> str:
    """The process's signal masks and where it sleeps, for a failure message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as exc:
        return str(exc)
    return " ".join(line for line in status if line.startswith(("State", "Sig", "Shd"))) + f" wchan={wchan}"


def _wait_draining(master: int, process: subprocess.Popen, timeout: float = 90) -> int:
    """The exit status, reading the pty meanwhile as a terminal would: a screen whose output nobody
    reads blocks in write() once the pty's buffer is full, and never gets to exit."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        assert time.monotonic() < deadline, f"helios top did not exit: {_signal_state(process.pid)}"
        if select.select([master], [], [], 0.2)[0]:
            try:
                os.read(master, 65536)
            except OSError:  # the slave side closed
                break
    return process.wait(timeout=max(1.0, deadline - time.monotonic()))


def _terminal_env() -> dict[str, str]:
    """The environment of a program started in the 50 x 160 pty: COLUMNS and LINES (which
    pytest-xdist sets to 80 x 24 in its workers) would override the pty's size."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return env | {"TERM": "xterm-256color"}


@pytest.mark.parametrize("quit_with", ["q", "ctrl-c"])
def test_terminal_dashboard_pauses_and_quits_and_restores_the_terminal(loaded_server: Server, quit_with: str) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    before = termios.tcgetattr(slave)
    process = subprocess.Popen(
        [sys.executable, "-m", "helios", "top", loaded_server.url, "--interval", "0.3"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=_terminal_env(),
    )
    seen: list[str] = []
    try:
        _read_until(master, process, "tokens/s out", seen)
        _read_until(master, process, "DEPTH", seen)
        assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak: keys arrive without Enter
        os.write(master, b"p")
        _read_until(master, process, "PAUSED", seen)
        seen.clear()  # from here on only paused frames, until space resumes
        os.write(master, b" ")
        _read_until(master, process, "every 0.3 s | p pause", seen)  # a header without PAUSED
        if quit_with == "q":
            os.write(master, b"q")
        else:
            process.send_signal(signal.SIGINT)  # what Ctrl-C sends from a controlling terminal
        assert _wait_draining(master, process) == 0  # generous: CI runs other test files beside this one
        assert termios.tcgetattr(slave) == before  # cooked mode again
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
        os.close(slave)
