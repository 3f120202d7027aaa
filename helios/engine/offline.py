"""Run requests to completion synchronously (tests, benchmarks, `helios generate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from helios.engine.engine import LLMEngine
from helios.engine.logprobs import TokenLogprobs
from helios.engine.request import EngineEvent, EngineRequest, FinishCause


@dataclass
class ChoiceOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: FinishCause | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: tuple | None = None
    error: str | None = None


def collect(outputs: dict[str, list[ChoiceOutput]], event: EngineEvent) -> None:
    choice = outputs[event.request_id][event.choice_index]
    choice.token_ids += event.token_ids
    choice.logprobs += event.logprobs or ()
    choice.num_cached_tokens = event.num_cached_tokens
    if event.prompt_logprobs is not None:
        choice.prompt_logprobs = event.prompt_logprobs
    if event.finish is not None:
        choice.finish, choice.error = event.finish, event.error


def run_to_completion(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[ChoiceOutput]]:
    outputs = {r.request_id: [ChoiceOutput() for _ in range(r.n)] for r in requests}
    for request in requests:
        reason = engine.check(request)
        if reason is not None:
            raise ValueError(reason)
        engine.add(request)
    while engine.has_work:
        for event in engine.step():
            collect(outputs, event)
    return outputs
