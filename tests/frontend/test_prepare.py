"""Frontend.prepare: one call from a neutral request to the engine requests the server submits.

Types are the decoders' (tests/protocols/test_sampling_types.py); here: range refusals and
clamps, max_tokens resolved in one place, the budget hint, and the server's single pool hop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend.checks import check_options
from helios.frontend.inference import (
    Conversation,
    InferenceRequest,
    LogprobOptions,
    Message,
    RawPrompt,
    RequestError,
    TextPart,
)
from helios.frontend.request import Frontend
from helios.protocols import anthropic_messages, openai_chat, openai_completions
from helios.server import generation
from helios.server.admission import AdmissionSlots
from helios.server.outcomes import RequestOutcomes
from tests.frontend.raw_requests import request_for

CHAT = Conversation((Message("user", (TextPart("hi"),)),))


@pytest.fixture(scope="module")
def frontend(tiny_core: Path) -> Frontend:
    return Frontend(Core.open(tiny_core), ServerConfig(default_max_tokens=64))


def _chat(**fields) -> InferenceRequest:
    return openai_chat.decode({"model": "x", "messages": [{"role": "user", "content": "hi"}], **fields})[0]


def test_one_engine_request_per_prompt_with_seeds_by_global_choice(frontend: Frontend) -> None:
    request, _ = openai_completions.decode({"model": "x", "prompt": ["a", "b c"], "n": 2, "seed": 5})
    prepared = frontend.prepare(request, "cmpl-1")
    assert prepared.num_choices == 4 and [p.prompt.text for p in prepared.inputs] == ["a", "b c"]
    engines = [p.engine for p in prepared.inputs]
    assert [e.request_id for e in engines] == ["cmpl-1.0", "cmpl-1.1"]  # type: ignore[union-attr]
    assert [[p.seed for p in e.params] for e in engines] == [[5, 6], [7, 8]]  # type: ignore[union-attr]
    assert all(e.prompt_ids == p.prompt.token_ids for e, p in zip(engines, prepared.inputs))  # type: ignore[union-attr]


def test_sampling_values_are_clamped_into_the_declared_ranges(frontend: Frontend) -> None:
    (params,) = frontend.prepare(_chat(temperature=0, top_p=5, top_k=1000), "c").inputs[0].engine.params  # type: ignore[union-attr]
    ranges = frontend.manifest.recipe.sampling.ranges
    assert (params.temperature, params.top_p, params.top_k) == (
        ranges["temperature"].min,
        ranges["top_p"].max,
        int(ranges["top_k"].max),
    )
    defaults = frontend.manifest.recipe.sampling.defaults
    assert frontend.prepare(_chat(), "c").inputs[0].engine.params[0].temperature == defaults.temperature  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (disabled) or a positive integer, got -2"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "logit_bias token id 99999999 is outside the vocabulary"),
        ({"logit_bias": {"3": -101}}, "logit_bias", "logit_bias values must be within [-100, 100], got -101"),
    ],
)
def test_out_of_range_sampling_values_are_refused_by_the_frontend(
    frontend: Frontend, fields: dict, param: str, message: str
) -> None:
    request = _chat(**fields)  # well typed: the decoder lets it through
    with pytest.raises(RequestError) as caught:
        frontend.prepare(request, "c")
    assert (caught.value.param, caught.value.message) == (param, message)


def test_max_tokens_is_resolved_once_into_each_engine_limit(frontend: Frontend) -> None:
    context = frontend.max_model_len

    def limit(max_tokens: int | None, text: str = "hello") -> int | None:
        request = request_for(text, max_tokens)
        engine = frontend.prepare(request, "r").inputs[0].engine
        return None if engine is None else engine.max_tokens

    prompt_len = len(frontend.prompt(RawPrompt(text="hello")).token_ids)
    assert limit(None) == 64  # [server] default_max_tokens
    assert limit(7) == 7
    assert limit(10**6) == context - prompt_len  # bounded by the context the prompt leaves, not refused
    assert limit(0) is None  # tokenize (and echo) only: nothing to run
    full = request_for((1,) * context)
    with pytest.raises(RequestError, match="leaves no room for output") as caught:
        frontend.prepare(full, "r")
    assert caught.value.param == "prompt"


def test_zero_tokens_with_prompt_scoring_runs_one_choice_for_all(frontend: Frontend) -> None:
    if not frontend.manifest.capabilities.prompt_logprobs:
        pytest.skip("the tiny core is exported with prompt logprobs")
    request = request_for("hi", 0, n=3, logprobs=LogprobOptions(prompt=1))
    engine = frontend.prepare(request, "s").inputs[0].engine
    assert engine is not None and (engine.n, engine.max_tokens, engine.prompt_logprobs) == (1, 0, 1)


def test_shared_checks_run_before_any_prompt_is_lowered(frontend: Frontend, monkeypatch) -> None:
    lowered = []
    monkeypatch.setattr(frontend, "prompt", lambda *args: lowered.append(args))
    with pytest.raises(RequestError, match="at most 20"):
        frontend.prepare(request_for(CHAT, 8, logprobs=LogprobOptions(top=21)), "c")
    assert lowered == []


def test_a_messages_budget_hint_is_dropped_where_the_model_cannot_cap(frontend: Frontend) -> None:
    assert frontend.manifest.recipe.reasoning_syntax in (None, "")  # the tiny smollm2 core: no reasoning syntax
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    hinted, _ = anthropic_messages.decode(
        {**body, "thinking": {"type": "enabled", "budget_tokens": 2000}}, headers_version="2023-06-01"
    )
    assert hinted.thinking_token_budget == 2000 and hinted.budget_is_hint
    prepared = frontend.prepare(hinted, "m")
    assert prepared.request.thinking_token_budget is None and prepared.inputs[0].engine.reasoning_budget is None  # type: ignore[union-attr]
    explicit, _ = anthropic_messages.decode({**body, "thinking_token_budget": 2000}, headers_version="2023-06-01")
    with pytest.raises(RequestError, match="needs a model with reasoning syntax"):
        frontend.prepare(explicit, "m")


def test_already_lowered_prompts_are_kept_as_they_are(frontend: Frontend) -> None:
    lowered = frontend.prompt(CHAT)
    request = request_for(lowered.token_ids)
    (child,) = frontend.prepare(request, "score", [lowered]).inputs
    assert child.prompt is lowered and child.engine.prompt_ids == lowered.token_ids  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- the server's one hop
class _Runner:
    def __init__(self) -> None:
        self.submitted = []

    def submit(self, prepared):
        self.submitted.append(prepared)
        return SimpleNamespace(request=prepared.request, request_id=prepared.request_id, generations=[])


def _state(frontend: Frontend, capacity: int = 4) -> SimpleNamespace:
    hops = []

    async def in_pool(fn, *args):
        hops.append(fn)
        return fn(*args)

    return SimpleNamespace(
        frontend=frontend,
        config=SimpleNamespace(max_concurrency=8),
        slots=AdmissionSlots(capacity),
        runner=_Runner(),
        in_pool=in_pool,
        hops=hops,
        outcomes=RequestOutcomes(),
    )


def test_the_server_prepares_in_one_pool_hop_then_admits_and_submits(frontend: Frontend) -> None:
    state = _state(frontend)
    run = asyncio.run(generation.start(state, _chat(n=2), "chatcmpl"))  # type: ignore[arg-type]
    assert state.hops == [frontend.prepare]
    (prepared,) = state.runner.submitted
    assert prepared.request_id.startswith("chatcmpl-") and run.reservation.held and state.slots.in_use == 2
    run.end(None)  # the client left: slots back, no outcome counted
    assert state.slots.in_use == 0


def test_range_errors_come_before_admission(frontend: Frontend) -> None:
    state = _state(frontend, capacity=1)
    held = state.slots.reserve(1)  # every admission slot taken: a valid request would get 429
    with pytest.raises(RequestError, match="top_k"):
        asyncio.run(generation.start(state, _chat(top_k=-5), "chatcmpl"))  # type: ignore[arg-type]
    assert state.runner.submitted == [] and state.slots.in_use == 1
    held.release()  # type: ignore[union-attr]


def test_a_core_without_generation_logprobs_refuses_logprobs(frontend: Frontend) -> None:
    """max_top_logprobs 0 (allow_logprobs false): logprobs at all is a 400 naming it (api.md)."""
    manifest = frontend.manifest
    bare = msgspec.structs.replace(
        manifest, capabilities=msgspec.structs.replace(manifest.capabilities, max_top_logprobs=0)
    )
    for fields in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 0}):
        with pytest.raises(RequestError) as refused:
            check_options(_chat(**fields), bare)
        assert refused.value.param == "logprobs" and "max-top-logprobs" in str(refused.value)
    check_options(_chat(), bare)  # no logprobs asked: fine
    check_options(_chat(logprobs=True), manifest)  # the exported core has them
