"""The `helios` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="helios",
    help="Serve Flare cores (built by `ignition export`) over OpenAI, Anthropic and Ollama-style APIs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def check(core: Annotated[Path, typer.Argument(help="Core directory.")]) -> None:
    """Open a core the way the server does (format version, checksums, programs) and report it."""
    from helios.core import Core, CoreError

    try:
        opened = Core.open(core)
        for kind in opened.manifest.programs:
            opened.load_program(kind)
    except CoreError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    m = opened.manifest
    typer.echo(f"{core}: {m.public_id} ({m.model.family}, {m.weights.num_parameters / 1e6:.1f}M parameters) loads")


@app.callback()
def _root() -> None:
    """Serve Flare cores."""


def main() -> None:
    app()
