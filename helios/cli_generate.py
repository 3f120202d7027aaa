"""`helios generate`: one request through the engine and the output pipeline, to stdout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from helios.config import ServerConfig
from helios.core import Core, CoreError
from helios.engine import EngineConfig, build_engine
from helios.frontend.detokenizer import TokenBytes
from helios.frontend.inference import (
    Conversation,
    InferenceRequest,
    Message,
    RawPrompt,
    RequestError,
    SamplingOptions,
    TextPart,
)
from helios.frontend.output import ChoiceOutput
from helios.frontend.request import Frontend


def run_generate(
    core_dir: Path, prompt: str, *, chat: bool, max_tokens: int, temperature: float | None, seed: int | None
) -> int:
    try:
        core = Core.open(core_dir)
    except CoreError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        return 2
    frontend = Frontend(core, ServerConfig())
    source = Conversation((Message("user", (TextPart(prompt),)),)) if chat else RawPrompt(text=prompt)
    sampling = SamplingOptions(temperature=temperature, seed=seed)
    request = InferenceRequest(input=source, sampling=sampling, max_tokens=max(max_tokens, 1))
    try:
        engine_request = frontend.prepare(request, "generate").inputs[0].engine
    except RequestError as exc:
        typer.secho(f"error: {exc.message}", fg=typer.colors.RED, err=True)
        return 2
    assert engine_request is not None  # a positive output limit always runs
    engine = build_engine(core, EngineConfig(num_pages=frontend.max_model_len // core.manifest.limits.page_tokens + 2))
    output = ChoiceOutput(
        TokenBytes(frontend.tokenizer), request.stop, request.logprobs, frozenset(core.manifest.tokenizer.eos_token_ids)
    )
    engine.add(engine_request)
    started = time.perf_counter()
    while engine.has_work:
        for event in engine.step():
            delta = output.push(event)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    typer.echo(
        f"[{output.num_generated} tokens in {elapsed:.2f}s, {output.num_generated / elapsed:.1f} tok/s]", err=True
    )
    return 0
