"""The `helios` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape  # help text is rich markup: "[server]" would vanish as a tag

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


@app.command()
def serve(
    core: Annotated[Path, typer.Argument(help="Core directory (from `ignition export`).")],
    config: Annotated[
        Path | None, typer.Option("--config", help=escape("TOML file with a [server] table (see docs/serving.md)."))
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option("--api-key-file", help="File holding the serving key (overrides [server] api_key)."),
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port to bind (default 8000).")] = None,
    log_level: Annotated[
        str,
        typer.Option("--log-level", help="critical, error, warning, info or debug (debug: where startup time goes)."),
    ] = "info",
    draft_core: Annotated[
        Path | None,
        typer.Option(
            "--draft-core",
            help=escape(
                "A small core with the same tokenizer that proposes speculative drafts (overrides [server] draft_core)."
            ),
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", help="Also show the libraries' own INFO lines (torch's compiler and shape logs)."),
    ] = False,
    tensor_parallel: Annotated[
        int | None,
        typer.Option(
            "--tensor-parallel", help=escape("Ranks to run on, one process each (overrides [parallel] tensor).")
        ),
    ] = None,
    expert_parallel: Annotated[
        bool | None,
        typer.Option("--expert-parallel", help="Split the experts across the ranks (a core exported so)."),
    ] = None,
    nnodes: Annotated[int | None, typer.Option("--nnodes", help="Machines the ranks run on.")] = None,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="This machine's index (0 serves HTTP).")] = None,
    master_addr: Annotated[str | None, typer.Option("--master-addr", help="Node 0's address (rendezvous).")] = None,
    master_port: Annotated[int | None, typer.Option("--master-port", help="Node 0's rendezvous port.")] = None,
    headless: Annotated[
        bool | None, typer.Option("--headless", help="Run this machine's ranks without serving HTTP (node-rank > 0).")
    ] = None,
    runtime: Annotated[
        str | None,
        typer.Option(
            "--runtime",
            help=escape("torch or onnxruntime (a core exported with --onnx; overrides [server] runtime)."),
        ),
    ] = None,
) -> None:
    """Serve a core: OpenAI Chat/Completions/Responses, Anthropic Messages, Ollama discovery, scoring, health, metrics."""
    import os

    from helios import cpu_isa
    from helios.hugepages import keep_freed_memory, reexec_with_huge_pages

    # Before torch loads OpenMP: pool threads spin only briefly (~10k iterations, tens of
    # microseconds) before sleeping. Inside a step the next parallel region starts within
    # that time, so no wake-up is paid per matmul or fused loop (PASSIVE, no spinning, made a
    # two-thread compiled step 54 ms instead of 25); between steps the threads sleep instead
    # of taking the cores the HTTP side needs (spinning for libgomp's default ~300k cost the
    # single stream up to 20%). OMP_WAIT_POLICY or GOMP_SPINCOUNT set by you win.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        # ACTIVE with a spin count, not the policy left unset: unset, libgomp throttles the
        # spin to 100 iterations when it sees other busy threads (steps 15-25% slower here).
        os.environ.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="10000")
    try:  # FLARE_CPU_ISA=avx2 (emulating an AVX2 host): torch must hear it before it starts
        cpu_isa.apply()
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    reexec_with_huge_pages()  # once, before anything large is allocated
    keep_freed_memory()  # a step's freed outputs serve the next step's (no page faults per step)
    import logging

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Their output is not ours: torch's INFO lines (symbolic shapes, compile threads, ...) speak
    # to torch's developers, not to people serving a model; --verbose shows them.
    quiet = logging.INFO if verbose else logging.WARNING
    for noisy in ("torch", "httpx", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(quiet, logging.getLogger().level))
    from helios.config import ConfigError, load_config
    from helios.core import CoreError
    from helios.engine import ParallelError
    from helios.server import ranks
    from helios.server.app import create_app
    from helios.server.lifecycle import serve as serve_until_signal
    from helios.server.state import build_state, resolve_device

    flags = {
        "tensor": tensor_parallel,
        "expert": expert_parallel,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "headless": headless,
    }
    try:
        settings = load_config(
            config,
            api_key_file=api_key_file,
            host=host,
            port=port,
            draft_core=draft_core,
            parallel={k: v for k, v in flags.items() if v is not None},
            runtime=runtime,
        )
        world = None
        if ranks.wanted(settings):
            joined = ranks.join(core, settings, resolve_device(settings), log_level)
            if isinstance(joined, int):  # a headless rank, stopped by rank 0
                raise typer.Exit(joined)
            world = joined
        state = build_state(core, settings, world)
    except (ConfigError, CoreError, ParallelError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    quantization = state.core.manifest.quantization
    weights = quantization.level if quantization is not None else state.core.manifest.weights.dtype
    running = state.client.metrics()
    if quantization is not None and running.weights_in_memory != quantization.level:
        weights += f" weights, held as {running.weights_in_memory} (docs/quantization.md)"
    elif running.upcast_from:
        weights += f" weights upcast to float32 at load: no {running.upcast_from} matmul here is as fast as float32"
    else:
        weights += " weights"
    weights += f", {running.step_kind} step, {running.attention_kernels} attention kernels"
    weights += f", on {running.device}, CUDA graphs {'on' if running.cuda_graphs else 'off'}"
    typer.echo(f"serving {state.model.public_id} ({weights}) on http://{settings.host}:{settings.port}/v1", err=True)
    serve_until_signal(create_app(state), state, settings.host, settings.port, log_level)


@app.command()
def generate(
    core: Annotated[Path, typer.Argument(help="Core directory.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt text.")] = ...,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt as a user turn with the chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 128,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (clamped to the core's range).")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed.")] = None,
) -> None:
    """Generate from a core and stream the text to stdout (a smoke test, no server)."""
    from helios.cli_generate import run_generate

    raise typer.Exit(run_generate(core, prompt, chat=chat, max_tokens=max_tokens, temperature=temperature, seed=seed))


@app.command()
def clients(
    client: Annotated[str, typer.Argument(help="codex, claude or opencode.")],
    core: Annotated[Path | None, typer.Argument(help="Core directory helios serves.")] = None,
    core_option: Annotated[
        Path | None, typer.Option("--core", help="Core directory (instead of the argument).")
    ] = None,
    url: Annotated[
        str | None,
        typer.Option("--url", help="helios' address (default: from --config, else http://127.0.0.1:8000)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="The TOML file helios serves with (aliases, key, port, default_max_tokens)."),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="The serving key file helios serves with.")
    ] = None,
) -> None:
    """Print a ready configuration of a coding client for a core: one shell block to paste."""
    from helios.clients import CLIENTS, target
    from helios.config import ConfigError, load_config
    from helios.core import Core, CoreError

    if client not in CLIENTS:
        typer.secho(f"error: unknown client {client!r} (choose {', '.join(CLIENTS)})", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if (core is None) == (core_option is None):
        typer.secho("error: give the core directory once, as an argument or with --core", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    try:
        settings = load_config(config, api_key_file=api_key_file)
        manifest = Core.open(core or core_option, verify_checksums=False).manifest  # type: ignore[arg-type]
    except (ConfigError, CoreError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(CLIENTS[client](target(manifest, settings, url)))


@app.command()
def top(
    url: Annotated[
        str,
        typer.Argument(metavar="URL", help="The server's address: http://host:port, host:port or its /v1 base URL."),
    ] = "http://127.0.0.1:8000",
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between samples.")] = 1.0,
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help="Sample twice one interval apart, print one plain snapshot and exit (1 if the server cannot be reached).",
        ),
    ] = False,
) -> None:
    """A live terminal dashboard of a running server: load, tokens/s, first-response time, KV pages, speculation.

    Also failures, and the host prefix store and recurrent state slots where the server has them.
    On a terminal it redraws in place (p or space pauses, q or Ctrl-C quits; works over SSH);
    when the output is not a terminal it prints a plain text block per interval. It reads
    GET /metrics, which needs no serving key.
    """
    from helios.top import run

    raise typer.Exit(run(url, interval, once))


@app.callback()
def _root() -> None:
    """Serve Flare cores."""


def main() -> None:
    app()
