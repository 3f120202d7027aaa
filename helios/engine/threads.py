"""The CPU thread policy, measured on this host at startup rather than tuned on another.

Small decode steps are memory-bound: on some machines one thread streams the weights about
as fast as two and cannot be stalled by a preempted pool thread; on others (wider memory
paths, AMX or AVX-512 BF16 units per core) every thread helps even at one row. The engine
times its own step program at a few row counts with one thread and with all of them, and
runs decode steps of up to `serial_rows` rows on one thread only where that was faster.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("helios.engine")

PROBE_ROWS = (1, 2, 4)
WARMUP, REPEATS = 2, 5
# Part of the key a remembered measurement is kept under (Executor._remembered): one taken before
# the steps were timed in turns (_paired_median_ms) is taken again.
METHOD = "in-turns"
ONE_THREAD_MARGIN = 0.95  # one thread must be at least 5% faster to be chosen (noise, and it leaves a core free)


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    threads: int  # torch threads for every step that is not a small decode
    serial_rows: int  # decode-only steps of at most this many rows run on one thread (0: never)
    timings_ms: dict[tuple[int, int], float]  # (rows, threads) -> median step time measured


def _cpu_jiffies() -> tuple[int, int] | None:
    """(every CPU's busy time, this process's CPU time), in clock ticks, from /proc; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, int(mine[11]) + int(mine[12])  # utime + stime


BUSY_SHARE = 0.25  # other processes took more than this share of the host's CPUs: a busy host


def measured_on_a_quiet_host(measure: Callable[[], int]) -> tuple[int, bool]:
    """measure(), and whether other processes left the host's CPUs to it meanwhile (False when
    they used more than BUSY_SHARE of them). A timing taken while something else ran (a build,
    a test run, another server) says little about serving and must not be remembered for later
    starts: the policy above measured 2 threads 15x slower than one on a busy 2-core host."""
    before, start = _cpu_jiffies(), time.perf_counter()
    value = measure()
    after, wall = _cpu_jiffies(), time.perf_counter() - start
    if before is None or after is None or wall <= 0:
        return value, True
    ticks = os.sysconf("SC_CLK_TCK")
    others = ((after[0] - before[0]) - (after[1] - before[1])) / ticks
    return value, others <= BUSY_SHARE * (os.cpu_count() or 1) * wall


def _paired_median_ms(first: Callable[[], None], second: Callable[[], None]) -> tuple[float, float]:
    """Median times of two steps measured in turns (first, second, second, first, ...), so that a
    host whose speed drifts while they are timed (a VM's neighbours, a memory bus that others
    share) slows both alike instead of whichever ran in the slow stretch. Timed one block after
    the other, a 2-core VM once measured one thread faster than two at one row and kept that
    choice: its one-stream speed fell by a quarter in every later start."""
    for _ in range(WARMUP):
        first()
        second()
    samples: tuple[list[float], list[float]] = ([], [])
    for turn in range(2 * REPEATS):
        which = (turn + turn // 2) % 2  # 0 1 1 0 0 1 1 0 ...
        start = time.perf_counter()
        (first, second)[which]()
        samples[which].append((time.perf_counter() - start) * 1000)
    return sorted(samples[0])[REPEATS // 2], sorted(samples[1])[REPEATS // 2]


def measure(decode_step: Callable[[int], None], threads: int, probe_rows: tuple[int, ...] = PROBE_ROWS) -> ThreadPolicy:
    """Time decode_step(rows) at `probe_rows` with 1 and `threads` threads, in turns; choose
    serial_rows."""
    timings: dict[tuple[int, int], float] = {}
    serial_rows = 0

    def on(count: int, rows: int) -> Callable[[], None]:
        def step() -> None:
            torch.set_num_threads(count)
            decode_step(rows)

        return step

    if threads > 1:
        for rows in probe_rows:
            timings[(rows, 1)], timings[(rows, threads)] = _paired_median_ms(on(1, rows), on(threads, rows))
            if timings[(rows, 1)] < ONE_THREAD_MARGIN * timings[(rows, threads)]:
                serial_rows = rows
            else:
                break  # more rows only favour more threads
        torch.set_num_threads(threads)
    policy = ThreadPolicy(threads, serial_rows, timings)
    log.info(
        "thread policy: decode steps of up to %d rows on one thread, else %d threads (%s)",
        serial_rows,
        threads,
        ", ".join(f"{r} rows x {t} threads: {ms:.1f} ms" for (r, t), ms in sorted(timings.items())),
    )
    return policy


SPECULATION_ROWS = (1, 2, 4, 8, 16, 32)
SPECULATION_COST = 2.0  # a step of this many times a one-row step's time still pays for its drafts


def measure_row_budget(decode_step: Callable[[int], None], probe_rows: tuple[int, ...] = SPECULATION_ROWS) -> int:
    """The most decode rows (sequences plus drafts) a step takes while it costs at most
    SPECULATION_COST one-row steps: below it a verified draft is nearly free (the step is
    memory-bound), past it drafts start to cost throughput. Each row count is timed in turns
    with a one-row step, and held to that one-row time."""
    budget = probe_rows[0]
    timings = []
    for rows in probe_rows[1:]:
        base, ms = _paired_median_ms(lambda: decode_step(probe_rows[0]), lambda: decode_step(rows))  # noqa: B023
        timings.append(f"{rows} rows: {ms:.1f} ms against {base:.1f}")
        if ms > SPECULATION_COST * base:
            break
        budget = rows
    log.info("speculation: up to %d decode rows per step (%s)", budget, ", ".join(timings))
    return budget
