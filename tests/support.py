"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from helios.engine.request import EngineRequest

ROOT = Path(__file__).resolve().parent.parent
SLOW_TESTS = "FLARE_SLOW_TESTS"  # =1: every slow suite whole (conftest's `sampled`, the router, 50 requests a format)


def slow_tests() -> bool:
    return os.environ.get(SLOW_TESTS) == "1"


# conftest.py's tiny_cores fixture: (family, recipe, seed, chat=None, vision=False, **options) -> (checkpoint, core)
TinyCores = Callable[..., tuple[Path, Path]]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a console entry point (`ignition ...` / `helios ...`). `ignition` without `env` runs in
    this process (Typer's runner, in the working directory a fresh process would have): starting
    Python and torch again cost 2-3 s of CI per call, and tests/test_cli_help.py runs the real
    console scripts. `helios` commands (servers, `top`) and calls with `env` (which libraries such
    as huggingface_hub read once, at import) get a fresh process."""
    program, *rest = args
    if program == "ignition" and env is None:
        return _ignition_in_process(rest)
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", program, *rest], capture_output=True, text=True, env=full_env, cwd=ROOT
    )


def _ignition_in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """ignition.cli.main(args) with its streams captured (Typer's runner), as the console script runs it."""
    from typer.testing import CliRunner

    from ignition.cli import main

    code, crash = 0, ""
    with contextlib.chdir(ROOT), CliRunner().isolation() as (stdout, stderr, _):
        try:
            main(args)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except Exception as error:  # noqa: BLE001 - what Python prints before exiting 1
            code, crash = 1, "".join(traceback.format_exception(error))
        sys.stdout.flush()  # the runner's text streams buffer what print() wrote
        sys.stderr.flush()
        out, err = stdout.getvalue().decode(), stderr.getvalue().decode()
    return subprocess.CompletedProcess(["ignition", *args], code, out, err + crash)


class ScriptedExecutor:
    """The real executor (real programs, KV pages, prefill), except that each sampled row's
    logits are replaced so the next token is the request's scripted one.

    Scripts are handed out to requests in arrival order; once the queue is empty, a `policy`
    (when set) writes the script from the request itself (its prompt ids), so a multi-turn
    client can be answered by what it sent. A request's choices share its script; past the
    script's end the model emits its first EOS token. Everything after the executor
    (sampler, output pipeline, parsers, encoders) is the production path.
    """

    def __init__(self, real, eos_id: int) -> None:
        self.real = real
        self.eos_id = eos_id
        self.queue: list[list[int]] = []
        self.assigned: dict[str, list[int]] = {}
        self.policy: Callable[[EngineRequest], list[int]] | None = None

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def script(self, token_ids: list[int]) -> None:
        self.queue.append(list(token_ids))

    def _next(self, request: EngineRequest) -> list[int]:
        if self.queue:
            return self.queue.pop(0)
        return list(self.policy(request)) if self.policy is not None else []

    def run(self, chunks, page_copies=(), *state_copies):
        import dataclasses

        result = self.real.run(chunks, page_copies, *state_copies)  # the engine hands the step's copies along
        logits = result.logits.clone()
        row = 0
        for chunk in result.sampled:  # a chunk with drafts has a row per position it verifies
            request = chunk.seq.request
            script = self.assigned.get(request.request_id)
            if script is None:
                script = self.assigned[request.request_id] = self._next(request)
            for offset in range(chunk.num_rows):
                position = chunk.seq.num_output + offset
                token = script[position] if position < len(script) else self.eos_id
                logits[row] = float("-inf")
                logits[row, token] = 0.0
                row += 1
        return dataclasses.replace(result, logits=logits, logsumexp=logits.logsumexp(dim=-1))


class KernelRecorder:
    """Stands in for the flare IMPL library a kernel family registers into: records the kernel
    each op gets in the `key` dispatch slot ("CPU", "CUDA")."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.kernels: dict[str, Callable] = {}

    def impl(self, name: str, kernel: Callable, key: str) -> None:
        assert key == self.key
        self.kernels[name] = kernel


def attend_spans(q, k_cache, v_cache, tables, spans: list[tuple[int, int]], window: int = 0) -> torch.Tensor:
    """flare::paged_attention over one step whose i-th sequence (table row i) holds keys [0, b) and
    queries q[a:b] for the i-th span (a, b): decode rows, short chunks and prompt chunks at once."""
    rows = torch.cat([q[a:b] for a, b in spans])
    starts = torch.tensor([0, *torch.tensor([b - a for a, b in spans]).cumsum(0).tolist()], dtype=torch.int32)
    return torch.ops.flare.paged_attention(
        rows,
        k_cache,
        v_cache,
        tables,
        torch.tensor([b for _, b in spans], dtype=torch.int32),
        starts,
        torch.cat([torch.arange(a, b) for a, b in spans]),
        0.125,
        window,
        0.0,
    )


def assert_takes_op_arguments(name: str, kernel: Callable) -> None:
    """`kernel` takes flare::`name`'s arguments as the dispatcher hands them over: its schema's
    names, in its order, with its defaults (helios.core.ops)."""
    schema = getattr(torch.ops.flare, name).default._schema
    expected = [
        (a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty) for a in schema.arguments
    ]
    parameters = inspect.signature(kernel).parameters.values()
    assert [(p.name, p.default) for p in parameters] == expected, name


ANTHROPIC_SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec" / "external" / "anthropic-hosted_spec.json"


def anthropic_spec() -> dict:
    """The hosted Anthropic API schema, with the `"type": null` it writes on Model removed
    (that is not JSON Schema)."""
    return _drop_null_types(json.loads(ANTHROPIC_SPEC.read_text()))


def _drop_null_types(node):
    if isinstance(node, dict):
        return {k: _drop_null_types(v) for k, v in node.items() if not (k == "type" and v is None)}
    if isinstance(node, list):
        return [_drop_null_types(v) for v in node]
    return node
