"""ignition export's progress: the phases export_core reports, one plain line each without a
terminal, a rich display on one; reporting never changes what is exported."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from support import run_cli

from helios.core import Core
from ignition.export import ExportOptions, export_core
from ignition.progress import export_phases
from ignition.recipe import load_recipe
from ignition.sources import open_source

PHASES = [
    "converting weights to float32",
    "exporting the step program",
    "exporting the scored_prefill program",
    "writing weights and tokenizer",
    "self-check against the reference forward",
    "writing core.json",
]


def test_export_core_reports_each_phase_and_exports_the_same_files(tiny_checkpoint: Path, tmp_path: Path) -> None:
    heard: list[str] = []
    results = []
    for out, progress in ((tmp_path / "told", heard.append), (tmp_path / "silent", None)):
        options = ExportOptions(out=out, prompt_logprobs=True)
        results.append(export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), options, progress))
    assert heard == PHASES
    told, silent = results
    assert told.manifest.files == silent.manifest.files  # every file's sha256
    assert Core.open(tmp_path / "told").digest == Core.open(tmp_path / "silent").digest


def test_cli_prints_one_line_per_phase_without_a_terminal(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = run_cli(
        "ignition",
        "export",
        str(tiny_checkpoint),
        "--recipe",
        "smollm2",
        "--out",
        str(tmp_path / "core"),
        "--prompt-logprobs",
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.endswith(" ...")]
    assert lines == [f"reading {tiny_checkpoint} ..."] + [f"{phase} ..." for phase in PHASES]
    assert "\x1b[" not in done.stderr and done.stdout.startswith(f"wrote {tmp_path / 'core'} (")


def test_cli_with_json_prints_no_phases(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = run_cli(
        "ignition", "export", str(tiny_checkpoint), "--recipe", "smollm2", "--out", str(tmp_path / "c"), "--json"
    )
    assert done.returncode == 0 and " ..." not in done.stderr


def _terminal() -> tuple[Console, io.StringIO]:
    sink = io.StringIO()
    return Console(file=sink, force_terminal=True, force_interactive=True, width=100, color_system=None), sink


def test_terminal_display_marks_phases_done() -> None:
    console, sink = _terminal()
    with export_phases(console) as phase:
        phase("reading [the] source")  # brackets are text, not markup
        phase("self-check against the reference forward")
    final = sink.getvalue().split("\x1b[2K")[-1]  # the display's last frame
    assert "done reading [the] source" in final and "done self-check against the reference forward" in final


def test_terminal_display_marks_the_failing_phase() -> None:
    console, sink = _terminal()
    with pytest.raises(RuntimeError), export_phases(console) as phase:
        phase("converting weights")
        phase("exporting the step program")
        raise RuntimeError("boom")
    final = sink.getvalue().split("\x1b[2K")[-1]
    assert "done converting weights" in final and "exporting the step program failed" in final
