"""How `ignition export` shows its phases: a rich display (spinner, then a tick and the time
each phase took) on a terminal, one plain line per phase otherwise (what CI logs and tests see)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def export_phases(console: Console | None = None, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A callback to hand export_core: each call ends the running phase and starts the named one;
    leaving the block ends the last (marked failed when an exception leaves it)."""
    console = console or Console(stderr=True)
    if quiet:
        yield lambda name: None
    elif not console.is_interactive:  # a pipe, a log, TERM=dumb: no cursor movement

        def line(name: str) -> None:
            console.file.write(f"{name} ...\n")
            console.file.flush()

        yield line
    else:
        with _display(console) as report:
            yield report


@contextlib.contextmanager
def _display(console: Console) -> Iterator[Callable[[str], None]]:
    columns = (SpinnerColumn(finished_text="[green]done"), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        running: list[TaskID] = []

        def report(name: str) -> None:
            if running:
                progress.update(running[-1], total=1, completed=1)
            running.append(progress.add_task(escape(name), total=None))

        try:
            yield report
        except BaseException:
            if running:
                task = progress.tasks[-1]
                progress.update(running[-1], description=f"{task.description} [red]failed")
                progress.stop_task(running[-1])
            raise
        if running:
            progress.update(running[-1], total=1, completed=1)
