"""The thread policy is measured, not assumed: one thread only where it was faster."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from helios.engine import threads


def test_one_thread_is_chosen_only_up_to_the_rows_where_it_wins(monkeypatch) -> None:
    costs = {(1, 1): 1.0, (1, 2): 2.0, (2, 1): 2.0, (2, 2): 2.5, (4, 1): 4.0, (4, 2): 2.5}  # ms, made up

    def step(rows: int) -> None:
        deadline = time.perf_counter() + costs[(rows, torch.get_num_threads())] / 1000
        while time.perf_counter() < deadline:
            pass

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: monkeypatch.setattr(torch, "get_num_threads", lambda: n))
    policy = threads.measure(step, 2)
    assert policy.serial_rows == 2 and set(policy.timings_ms) == {(r, t) for r in (1, 2, 4) for t in (1, 2)}
    assert torch.get_num_threads() == 2
    monkeypatch.undo()
    assert torch.get_num_threads() == before


def test_a_single_threaded_host_never_measures() -> None:
    assert threads.measure(lambda rows: None, 1).serial_rows == 0


def test_speculation_row_budget_is_the_last_row_count_within_twice_one_row(monkeypatch) -> None:
    from helios.engine import threads

    timings = {1: 10.0, 2: 11.0, 4: 12.5, 8: 16.0, 16: 25.0, 32: 48.0}  # ms per step at each row count
    rows_seen: list[int] = []

    def fake_paired(first, second) -> tuple[float, float]:
        first()
        second()
        return timings[rows_seen[-2]], timings[rows_seen[-1]]

    monkeypatch.setattr(threads, "_paired_median_ms", fake_paired)
    assert threads.measure_row_budget(rows_seen.append) == 8  # 16 rows cost 2.5 one-row steps
    assert rows_seen == [1, 2, 1, 4, 1, 8, 1, 16]  # each against one row; stops past the budget


def test_the_two_steps_of_a_pair_are_timed_in_turns() -> None:
    """A host that slows down halfway through the measurement slows both steps alike: timed one
    block after the other, the second step would take all of the slow stretch."""
    order: list[str] = []
    threads._paired_median_ms(lambda: order.append("a"), lambda: order.append("b"))
    timed = order[2 * threads.WARMUP :]
    assert timed.count("a") == timed.count("b") == threads.REPEATS
    half = len(timed) // 2
    assert timed[:half].count("a") in (half // 2, (half + 1) // 2)  # each half holds both steps


def test_a_measurement_taken_while_the_host_is_busy_is_not_called_quiet() -> None:
    """Other processes using the CPUs during a startup measurement: it is used for this run but
    not remembered (Executor._remembered), so a later start on a quiet host measures again."""
    if threads._cpu_jiffies() is None:
        pytest.skip("no /proc here")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)  # the hogs are running
        value, quiet = threads.measured_on_a_quiet_host(lambda: (time.sleep(1.0), 7)[1])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert value == 7 and not quiet
