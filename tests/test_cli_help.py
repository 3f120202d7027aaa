"""The command-line help reads as written (rich markup must not eat bracketed words)."""

from __future__ import annotations

import warnings

from typer.testing import CliRunner

from helios.cli import app as helios_app
from ignition.sources import open_source


def test_serve_help_names_the_server_table() -> None:
    result = CliRunner().invoke(helios_app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "TOML file with a [server] table" in result.output


def test_reading_the_default_gguf_warns_about_nothing(smollm2_gguf) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "not writable" warning would fail here
        checkpoint = open_source(str(smollm2_gguf), "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert checkpoint is not None
