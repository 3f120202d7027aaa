"""What `helios top` shows: the rates of one sampling interval, drawn as a rich dashboard or plain text.

Every function here is pure: (previous snapshot, current snapshot, elapsed seconds, history)
in, a renderable or a string out, so tests render recorded /metrics JSON without a server.
Fetching, keys and the redraw loop live in terminal.py.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

Snapshot = Mapping[str, Any]  # one GET /metrics?format=json object; an absent field reads as zero
BLOCKS = " ▁▂▃▄▅▆▇█"  # a zero sample is blank, any positive one at least the lowest block
ASCII_BLOCKS = " .:-=+*#%@"  # for terminals that cannot print the blocks
PLAIN_PLOT_WIDTH = 40
HOST_FIELDS = (
    "host_hits",
    "host_reused_tokens",
    "host_memory_records",
    "host_disk_records",
    "host_bytes_in",
    "host_bytes_out",
)


class History:
    """Tokens/s in and out over the last `capacity` intervals, oldest first: the plots' data."""

    def __init__(self, capacity: int = 240, tokens_in: Iterable[float] = (), tokens_out: Iterable[float] = ()) -> None:
        self.tokens_in: deque[float] = deque(tokens_in, maxlen=capacity)
        self.tokens_out: deque[float] = deque(tokens_out, maxlen=capacity)

    def record(self, prev: Snapshot | None, cur: Snapshot, elapsed: float) -> None:
        if prev is None:
            return
        self.tokens_in.append(rate(prev, cur, "prefill_tokens", elapsed) or 0.0)
        self.tokens_out.append(rate(prev, cur, "generated_tokens", elapsed) or 0.0)

    def copy(self) -> History:
        return History(self.tokens_in.maxlen or 1, self.tokens_in, self.tokens_out)


@dataclass(frozen=True, slots=True)
class Status:
    """How the dashboard is being watched, beside what the server reported."""

    url: str  # the server's base address, as shown in the header
    interval: float = 1.0  # seconds between samples
    paused: bool = False  # the display is frozen at this sample
    interactive: bool = False  # keys work: the header names them
    fetch_errors: int = 0  # failed fetches since the dashboard started
    last_error: str | None = None  # why the newest fetch failed; None while the server answers


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    value: str  # ASCII only, so plain output survives any terminal encoding
    plot: tuple[float, ...] = ()  # samples to draw after the value, oldest first; fewer than two draw nothing


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    rows: tuple[Row, ...]


# ---------------------------------------------------------------------------- numbers
def number(snapshot: Snapshot | None, key: str) -> float:
    value = snapshot.get(key) if snapshot is not None else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def delta(prev: Snapshot | None, cur: Snapshot, key: str) -> float | None:
    """How much a counter grew over the interval; None without a previous sample or when the
    server restarted in between (its uptime or the counter went back)."""
    if prev is None or number(cur, "uptime_seconds") < number(prev, "uptime_seconds"):
        return None
    grown = number(cur, key) - number(prev, key)
    return grown if grown >= 0 else None


def rate(prev: Snapshot | None, cur: Snapshot, key: str, elapsed: float) -> float | None:
    grown = delta(prev, cur, key)
    return None if grown is None or elapsed <= 0 else grown / elapsed


def ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else part / whole


def _count(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _per_second(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}/s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _counted(prev: Snapshot | None, cur: Snapshot, key: str, elapsed: float) -> str:
    """A counter's total and its rate over the interval: "44 (2.0/s)"."""
    return f"{_count(number(cur, key))} ({_per_second(rate(prev, cur, key, elapsed))})"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _uptime(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m{whole % 60:02d}s"


def _labelled(counts: Any) -> str:
    entries = [(str(key), value) for key, value in dict(counts or {}).items() if value]
    return ", ".join(f"{key} {int(value):,}" for key, value in sorted(entries)) or "none"


# ---------------------------------------------------------------------------- what is shown
def speculating(cur: Snapshot) -> bool:
    """Drafts were ever offered: DEPTH and acceptance mean something."""
    return number(cur, "verification_drafts") > 0 or number(cur, "draft_steps") > 0 or bool(cur.get("learned_drafter"))


def has_host_cache(cur: Snapshot) -> bool:
    """The server runs a host prefix store (it reports parked records) or one has ever held or moved anything."""
    return (
        "host_cache_parked_records" in cur
        or any(number(cur, key) for key in HOST_FIELDS)
        or bool(cur.get("host_cache_held"))
        or bool(cur.get("host_cache_dropped"))
    )


def sections(
    prev: Snapshot | None, cur: Snapshot, elapsed: float, history: History, status: Status | None = None
) -> tuple[Section, ...]:
    """The dashboard's content; the speculation, host-cache and state-slot sections only where they apply."""
    out = [_requests(prev, cur, elapsed), _tokens(prev, cur, elapsed, history), _latency(cur), _kv(prev, cur)]
    if speculating(cur):
        out.append(_speculation(prev, cur))
    if has_host_cache(cur):
        out.append(_host_cache(prev, cur, elapsed))
    if number(cur, "state_slots") > 0:
        out.append(_state_slots(cur))
    out.append(_errors(prev, cur, elapsed, status))
    return tuple(out)


def _requests(prev: Snapshot | None, cur: Snapshot, elapsed: float) -> Section:
    rows = [
        Row("active", _count(number(cur, "active"))),
        Row("pending", _count(number(cur, "pending"))),
        Row("completed", _counted(prev, cur, "completed", elapsed)),
    ]
    if "preemptions_total" in cur:
        rows.append(Row("preemptions", _counted(prev, cur, "preemptions_total", elapsed)))
    if "http_admission_capacity" in cur:
        rows.append(
            Row(
                "HTTP slots",
                f"{_count(number(cur, 'http_admission_in_use'))} of "
                f"{_count(number(cur, 'http_admission_capacity'))} in use",
            )
        )
    return Section("Requests", tuple(rows))


def _tokens(prev: Snapshot | None, cur: Snapshot, elapsed: float, history: History) -> Section:
    rows = []
    for label, key, samples in (
        ("tokens/s in", "prefill_tokens", history.tokens_in),
        ("tokens/s out", "generated_tokens", history.tokens_out),
    ):
        now = rate(prev, cur, key, elapsed)
        plotted = tuple(samples) if len(samples) > 1 else ()  # one sample is no trend
        peak = f" (peak {max(plotted):,.1f})" if plotted else ""
        rows.append(Row(label, ("-" if now is None else f"{now:,.1f}") + peak, plotted))
    weight_bytes = number(cur, "decode_weight_bytes")
    steps = rate(prev, cur, "verify_steps", elapsed)
    if not weight_bytes:
        weights = "- (the core declares no decode_weight_bytes)"
    elif steps is None:
        weights = f"- ({_bytes(weight_bytes)} per step)"
    else:
        weights = f"{weight_bytes * steps / 1e9:.2f} GB/s ({steps:,.1f} steps/s x {_bytes(weight_bytes)})"
    rows.append(Row("WEIGHTS", weights))
    return Section("Tokens", tuple(rows))


def _latency(cur: Snapshot) -> Section:
    first = cur.get("first_response") or {}
    median = first.get("median_seconds")
    window = first.get("window_seconds", 60)
    samples = f"{int(first.get('samples') or 0):,} in the last {window:g} s"
    if first.get("truncated"):
        samples += " (truncated: more than capacity)"
    return Section(
        "First response",
        (Row("TTFT median", "-" if median is None else _duration(float(median))), Row("TTFT samples", samples)),
    )


def _kv(prev: Snapshot | None, cur: Snapshot) -> Section:
    total, free, cached = number(cur, "total_pages"), number(cur, "free_pages"), number(cur, "cached_pages")
    used = number(cur, "used_pages") if "used_pages" in cur else max(total - free - cached, 0)
    reused, prefilled = delta(prev, cur, "reused_tokens"), delta(prev, cur, "prefill_tokens")
    prompt = None if reused is None or prefilled is None else reused + prefilled
    reuse = "-" if not prompt else f"{_percent(ratio(reused, prompt))} ({_count(reused)} of {_count(prompt)} tokens)"
    page_tokens = number(cur, "page_tokens")
    return Section(
        "KV pages",
        (
            Row("free", _count(free)),
            Row("cached", _count(cached)),
            Row("used", f"{_count(used)} ({_percent(ratio(used, total))})"),
            Row("total", _count(total) + (f" ({int(page_tokens)} tokens each)" if page_tokens else "")),
            Row("prefix reuse", reuse),
        ),
    )


def _speculation(prev: Snapshot | None, cur: Snapshot) -> Section:
    drafts, rounds = delta(prev, cur, "verification_drafts"), delta(prev, cur, "verification_rounds")
    accepted, offered = delta(prev, cur, "accepted_drafts"), delta(prev, cur, "draft_rounds")
    depth = ratio(drafts, rounds)
    acceptance = ratio(accepted, drafts)
    return Section(
        "Speculation",
        (
            Row("DEPTH", "-" if depth is None else f"{depth:.2f} ({_count(drafts)} drafts / {_count(rounds)} rounds)"),
            Row(
                "acceptance",
                "-" if acceptance is None else f"{_percent(acceptance)} ({_count(accepted)} of {_count(drafts)})",
            ),
            Row("drafted rounds", _percent(ratio(offered, rounds))),
            Row("drafter", _drafter(cur)),
        ),
    )


def _drafter(cur: Snapshot) -> str:
    if not cur.get("learned_drafter"):
        return "prompt and output history"
    name = cur.get("learned_drafter_name")
    learned = "the core's MTP layers" if name == "mtp" else f"draft core {name}" if name else "learned"
    return f"{learned}; history on long matches"


def _host_cache(prev: Snapshot | None, cur: Snapshot, elapsed: float) -> Section:
    def moved(key: str) -> str:
        speed = rate(prev, cur, key, elapsed)
        return f"{_bytes(number(cur, key))} ({'-' if speed is None else _bytes(speed) + '/s'})"

    rows = [
        Row("memory records", _count(number(cur, "host_memory_records"))),
        Row("disk records", _count(number(cur, "host_disk_records"))),
    ]
    if "host_cache_parked_records" in cur:
        rows.append(Row("parked for disk", _count(number(cur, "host_cache_parked_records"))))
    rows += [
        Row("hits", _counted(prev, cur, "host_hits", elapsed)),
        Row("reused tokens", _counted(prev, cur, "host_reused_tokens", elapsed)),
        Row("bytes in", moved("host_bytes_in")),
        Row("bytes out", moved("host_bytes_out")),
        Row("held (total)", _labelled(cur.get("host_cache_held"))),
        Row("dropped (total)", _labelled(cur.get("host_cache_dropped"))),
    ]
    return Section("Host cache", tuple(rows))


def _state_slots(cur: Snapshot) -> Section:
    slot_bytes = number(cur, "state_slot_bytes")
    rows = [
        Row("slots used", f"{_count(number(cur, 'state_slots_used'))} of {_count(number(cur, 'state_slots'))}"),
        Row("snapshots", _count(number(cur, "state_snapshots"))),
    ]
    if slot_bytes:
        rows.append(Row("slot size", _bytes(slot_bytes)))
    return Section("State slots", tuple(rows))


def _errors(prev: Snapshot | None, cur: Snapshot, elapsed: float, status: Status | None) -> Section:
    failed = Row("failed", _counted(prev, cur, "failed", elapsed))
    if status is None or (status.last_error is None and not status.fetch_errors):
        connection = "ok"
    elif status.last_error is None:
        connection = f"ok ({status.fetch_errors:,} failed fetches earlier)"
    else:
        connection = f"unreachable ({status.fetch_errors:,} failed fetches)"
    return Section("Errors", (failed, Row("connection", connection)))


def _header(cur: Snapshot, status: Status | None) -> str:
    if status is None:
        return "helios top"
    parts = [f"helios top {status.url}"]
    if "uptime_seconds" in cur:
        parts.append(f"up {_uptime(number(cur, 'uptime_seconds'))}")
    parts.append(f"every {status.interval:g} s")
    if status.last_error is not None:
        parts.append("UNREACHABLE")
    if status.paused:
        parts.append("PAUSED")
    if status.interactive:
        parts.append("p pause, q quit")
    line = " | ".join(parts)
    return line if status.last_error is None else f"{line}\nerror: {status.last_error}"


# ---------------------------------------------------------------------------- drawing
def spark(samples: Iterable[float], width: int, blocks: str = BLOCKS) -> str:
    """The last `width` samples as one character each, scaled to the largest of them."""
    shown = list(samples)[-width:] if width > 0 else []
    top = max(shown, default=0.0)
    levels = len(blocks) - 1
    return "".join(blocks[min(levels, math.ceil(v / top * levels))] if top > 0 and v > 0 else blocks[0] for v in shown)


class Plot:
    """A sparkline as wide as the space the table leaves it."""

    def __init__(self, samples: tuple[float, ...]) -> None:
        self.samples = samples

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        blocks = BLOCKS if options.encoding.lower().startswith("utf") else ASCII_BLOCKS
        yield Segment(spark(self.samples, options.max_width, blocks), console.get_style("green"))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def _panel(section: Section, expand: bool = False) -> Panel:
    """The section's rows in a titled box; `expand`: as wide as the space (the plots take the rest)."""
    plots = any(row.plot for row in section.rows)
    table = Table.grid(padding=(0, 2), expand=plots)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    if plots:
        table.add_column(ratio=1)
    for row in section.rows:
        table.add_row(row.label, row.value, *([Plot(row.plot)] if row.plot else []))
    return Panel(table, title=section.title, title_align="left", expand=expand)


class Panels:
    """Panels in as many columns (up to three) as the width holds, each added to the shortest column."""

    def __init__(self, sections: list[Section]) -> None:
        self.sections = sections

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = [Measurement.get(console, options, _panel(section)).maximum for section in self.sections]
        for count in range(min(3, len(self.sections)), 0, -1):
            stacks = self._stacks(count)
            if count == 1 or sum(max(widths[i] for i in stack) for stack in stacks) + count - 1 <= options.max_width:
                break
        grid = Table.grid(padding=(0, 1), expand=True)
        for stack in stacks:  # each column at least as wide as its widest panel
            grid.add_column(min_width=max(widths[i] for i in stack))
        grid.add_row(*(Group(*(_panel(self.sections[i], expand=True) for i in stack)) for stack in stacks))
        yield grid

    def _stacks(self, count: int) -> list[list[int]]:
        stacks: list[list[int]] = [[] for _ in range(count)]
        heights = [0] * count
        for index, section in enumerate(self.sections):
            shortest = heights.index(min(heights))
            stacks[shortest].append(index)
            heights[shortest] += len(section.rows) + 2  # the borders
        return stacks


def dashboard(
    prev: Snapshot | None, cur: Snapshot, elapsed: float, history: History, status: Status | None = None
) -> RenderableType:
    """The live view: a header line, the token rates with their plots, then one panel per section."""
    parts = sections(prev, cur, elapsed, history, status)
    down = status is not None and status.last_error is not None
    style = "bold reverse red" if down else "bold reverse" if status is not None and status.paused else "bold"
    tokens = next(section for section in parts if section.title == "Tokens")
    others = [section for section in parts if section is not tokens]
    return Group(Text(_header(cur, status), style=style), _panel(tokens, expand=True), Panels(others))


def plain(
    prev: Snapshot | None,
    cur: Snapshot,
    elapsed: float,
    history: History,
    status: Status | None = None,
    blocks: str = BLOCKS,
) -> str:
    """The same content as text: a header line, then each section's title and indented rows."""
    parts = sections(prev, cur, elapsed, history, status)
    width = max(len(row.label) for section in parts for row in section.rows)
    lines = [_header(cur, status)]
    for section in parts:
        lines.append(section.title)
        for row in section.rows:
            plot = f"  [{spark(row.plot, PLAIN_PLOT_WIDTH, blocks)}]" if row.plot else ""
            lines.append(f"  {row.label:<{width}}  {row.value}{plot}")
    return "\n".join(lines) + "\n"
