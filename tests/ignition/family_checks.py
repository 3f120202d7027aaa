"""Checks every architecture family's tests run on its exported tiny core: the engine's
generated-token logprobs against transformers, and batching invariance through the engine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import SamplingParams
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "The quick brown fox jumps over the lazy dog, then it runs far away into the forest.",
    "Hi",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
]


def export_tiny(family: str, recipe: str, tmp_path_factory) -> tuple[Path, Path]:
    """(tiny random checkpoint of `family`, its core with prompt logprobs)."""
    checkpoint = write_testmodel(family, tmp_path_factory.mktemp("ckpt") / f"tiny-{family}", seed=3)
    core = tmp_path_factory.mktemp("cores") / f"tiny-{family}"
    export_core(open_source(str(checkpoint)), load_recipe(recipe), ExportOptions(out=core, prompt_logprobs=True))
    return checkpoint, core


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' full-vocabulary logprobs [T, V] for one sequence."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_generation_matches(core_dir: Path, model, text: str, max_tokens: int) -> None:
    """Each greedy token's logprob and top alternatives equal transformers' on the whole sequence."""
    core = Core.open(core_dir)
    prompt = tuple(core.tokenizer().encode(text).ids)
    engine = build_engine(core, EngineConfig(num_pages=64, prefill_chunk_size=16))
    request = EngineRequest("g", prompt, (GREEDY,), max_tokens, ignore_eos=True, num_top_logprobs=3)
    out = run_to_completion(engine, [request])["g"][0]
    expected = hf_logprobs(model, list(prompt) + out.token_ids)
    for step, entry in enumerate(out.logprobs):
        row = expected[len(prompt) - 1 + step]
        assert abs(entry.logprob - float(row[entry.token_id])) <= 1e-3
        assert max(abs(v - float(row[t])) for t, v in entry.alternatives) <= 1e-3


def check_batching_invariance(core_dir: Path, texts: list[str], max_tokens: int = 12) -> None:
    """Prompts together (16-token chunks, mixed prefill and decode rows) == each alone, and a
    second round from cached prefix pages too."""
    core = Core.open(core_dir)
    tok = core.tokenizer()
    requests = [
        EngineRequest(f"r{i}", tuple(tok.encode(t).ids), (GREEDY,), max_tokens, ignore_eos=True)
        for i, t in enumerate(texts)
    ]
    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    alone = {r.request_id: run_to_completion(solo, [r])[r.request_id][0].token_ids for r in requests}
    engine = build_engine(core, EngineConfig(num_pages=128, prefill_chunk_size=16))
    together = run_to_completion(engine, requests)
    assert {rid: choices[0].token_ids for rid, choices in together.items()} == alone
    again = run_to_completion(engine, [replace(r, request_id=r.request_id + "b") for r in requests])
    assert {rid[:-1]: choices[0].token_ids for rid, choices in again.items()} == alone
    assert sum(choices[0].num_cached_tokens for choices in again.values()) > 0


# Eight prompts behind a shared preamble (check_eight_prompts_batching), and a second set the MLA families use.
PREAMBLE = "You are a helpful assistant. Answer briefly and precisely. "
EIGHT_TEXTS = (*TEXTS, "Water boils at", "My favourite colour is", "1, 2, 3, 4,", "The capital of France is")
LONG_PREAMBLE = "You are a helpful assistant. Answer briefly and precisely, and never make things up. "
SHORT_TEXTS = (
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there lived",
    "1, 2, 3, 4,",
    "Water boils at",
    "My favourite colour is",
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
)
CHUNKED_CACHE_ON_OFF = ({"prefill_chunk_size": 16}, {"prefill_chunk_size": 16, "enable_prefix_cache": False})


def check_eight_prompts_batching(
    core_dir: Path,
    preamble: str = PREAMBLE,
    texts: tuple[str, ...] = EIGHT_TEXTS,
    settings: tuple[dict[str, object], ...] = CHUNKED_CACHE_ON_OFF,
) -> None:
    """The prompts behind a shared preamble together == each alone, under each of `settings`
    (EngineConfig overrides), and again, from cached prefix pages (and state snapshots) exactly where
    the prefix cache is on."""
    core = Core.open(core_dir)
    tok = core.tokenizer()
    requests = [
        EngineRequest(f"r{i}", tuple(tok.encode(preamble + t).ids), (GREEDY,), 12, ignore_eos=True)
        for i, t in enumerate(texts)
    ]

    def tokens(outputs: dict) -> dict[str, list[int]]:
        return {rid: choices[0].token_ids for rid, choices in outputs.items()}

    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    alone: dict[str, list[int]] = {}
    for request in requests:
        alone.update(tokens(run_to_completion(solo, [request])))
    for overrides in settings:
        engine = build_engine(core, EngineConfig(num_pages=128, **overrides))  # type: ignore[arg-type]
        assert tokens(run_to_completion(engine, requests)) == alone, f"batched output differs with {overrides}"
        again = run_to_completion(engine, [replace(r, request_id=r.request_id + "b") for r in requests])
        assert {k[:-1]: v for k, v in tokens(again).items()} == alone
        cached = sum(c[0].num_cached_tokens for c in again.values())
        assert (cached > 0) == overrides.get("enable_prefix_cache", True)


def check_prefix_reuse(core_dir: Path, text: str, max_tokens: int = 8) -> None:
    """A second request sharing a long prefix with an earlier one reuses it (cached tokens > 0;
    for a core with recurrent state, through the state snapshot taken at that boundary) and
    generates exactly what an uncached run does."""
    core = Core.open(core_dir)
    tok = core.tokenizer()
    prefix = tuple(tok.encode(text).ids)
    first = EngineRequest(
        "first", prefix + tuple(tok.encode(" Then the end.").ids), (GREEDY,), max_tokens, ignore_eos=True
    )
    second = EngineRequest(
        "second", prefix + tuple(tok.encode(" And so on.").ids), (GREEDY,), max_tokens, ignore_eos=True
    )
    assert len(prefix) > 2 * core.manifest.limits.page_tokens, "the shared prefix must cover whole pages"
    uncached = run_to_completion(build_engine(core, EngineConfig(num_pages=64, enable_prefix_cache=False)), [second])
    engine = build_engine(core, EngineConfig(num_pages=64, prefill_chunk_size=16))
    run_to_completion(engine, [first])
    cached = run_to_completion(engine, [second])["second"][0]
    assert cached.num_cached_tokens > 0
    assert cached.token_ids == uncached["second"][0].token_ids


# (route, its finish reason for a tool call) of each protocol tool_round_trip drives.
TOOL_ROUTES = (("chat", "tool_calls"), ("messages", "tool_use"), ("responses", "completed"))


def tool_round_trip(app, route: str, ask: str, schema: dict, **extra) -> tuple[dict, str]:
    """One user turn offering a get_weather tool through `route` ("chat", "messages" or "responses")
    of a scripted in-process server (tests/server/scripted.py), after app.say(...) scripted the
    model's output: ({"reasoning", "text", "calls": [(name, arguments)]}, finish reason or status)."""
    if route == "chat":
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": ask}],
            "max_tokens": 256,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
            **extra,
        }
        response = app.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        return {"reasoning": message["reasoning_content"], "text": message["content"], "calls": calls}, choice[
            "finish_reason"
        ]
    if route == "messages":
        body = {
            "model": "x",
            "max_tokens": 256,
            "messages": [{"role": "user", "content": ask}],
            "tools": [{"name": "get_weather", "input_schema": schema}],
            **extra,
        }
        response = app.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert response.status_code == 200, response.text
        result = response.json()
        blocks = result["content"]
        return {
            "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "text": "".join(b["text"] for b in blocks if b["type"] == "text"),
            "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
        }, result["stop_reason"]
    assert route == "responses", route
    body = {
        "model": "x",
        "input": ask,
        "max_output_tokens": 256,
        "tools": [{"type": "function", "name": "get_weather", "parameters": schema}],
        **extra,
    }
    response = app.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    output = result["output"]
    return {
        "reasoning": "".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]),
        "text": "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"]),
        "calls": [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"],
    }, result["status"]


def step_logprob_error(
    core_dir: Path, model, prompts: list[list[int]], decoded: int = 0, chunks: tuple[int | None, ...] = (None, 16, 5)
) -> float:
    """Max |Δ| of the step program's logprobs against transformers' full distributions over the prompts:
    each prefilled whole (None) and in each of `chunks`-token chunks, then its first `decoded` tokens one
    at a time (decode rows)."""
    from helios.core.program import run_prompt

    core = Core.open(core_dir)
    program, weights, m = core.load_program(), core.load_weights(), core.manifest
    page = m.limits.page_tokens
    worst = 0.0
    for ids in prompts:
        expected = hf_logprobs(model, list(ids))
        for chunk in chunks:
            got = run_prompt(program, weights, m.kv, page, list(ids), chunk=chunk).logprobs
            worst = max(worst, float((got - expected).abs().max()))
        if decoded:
            got = run_prompt(program, weights, m.kv, page, list(ids[:decoded]), chunk=1).logprobs
            worst = max(worst, float((got - expected[:decoded]).abs().max()))
    return worst


def prompt_logprob_error(core_dir: Path, model, prompts: list[list[int]], chunk: int) -> float:
    """Max |Δ| of the scored-prefill program's prompt logprobs and top alternatives (prefilled in
    `chunk`-token chunks) against transformers' full distributions, over the prompts."""
    from helios.core.program import SCORED_PREFILL, run_prompt

    core = Core.open(core_dir)
    program, weights, m = core.load_program(SCORED_PREFILL), core.load_weights(), core.manifest
    worst = 0.0
    for ids in prompts:
        run = run_prompt(program, weights, m.kv, m.limits.page_tokens, list(ids), chunk=chunk)
        expected = hf_logprobs(model, list(ids))
        scored = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        worst = max(worst, float((run.outputs["prompt_logprobs"][:-1] - scored).abs().max()))
        top = expected[:-1].gather(1, run.outputs["prompt_top_ids"][:-1])
        worst = max(worst, float((run.outputs["prompt_top_logprobs"][:-1] - top).abs().max()))
    return worst
