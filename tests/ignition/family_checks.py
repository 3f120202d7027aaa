"""Checks every architecture family's tests run on its exported tiny core: the engine's
generated-token logprobs against transformers, and batching invariance through the engine; and the
pieces the family test modules share: tiny checkpoints and their variants, transformers' models,
prompts, and tool-call round trips through a served core with a scripted model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support import TinyCores

from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import SamplingParams
from ignition.models import FAMILIES
from ignition.sources import open_source
from ignition.testmodel import _tensor, write_testmodel

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "The quick brown fox jumps over the lazy dog, then it runs far away into the forest.",
    "Hi",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
]


def export_tiny(
    family: str, recipe: str, tiny_cores: TinyCores, seed: int = 3, prompt_logprobs: bool = True
) -> tuple[Path, Path]:
    """(tiny random checkpoint of `family`, its core, with prompt logprobs unless not `prompt_logprobs`),
    built once per test run (conftest.py's tiny_cores): the family's tests and the engine's share it."""
    return tiny_cores(family, recipe, seed, prompt_logprobs=prompt_logprobs)


def write_variant(
    family: str, out: Path, changes: Mapping[str, object], seed: int, dropped: Iterable[str] = ()
) -> Path:
    """A tiny checkpoint of `family` whose test config has `changes` (a None value written as null) and
    none of the `dropped` fields, its tensors made again to fit (as write_testmodel makes them)."""
    write_testmodel(family, out, seed=seed)
    if not changes and not dropped:
        return out
    config = json.loads((out / "config.json").read_text()) | dict(changes)
    config = {k: v for k, v in config.items() if k not in set(dropped)}
    fam = FAMILIES[family]
    generator = torch.Generator().manual_seed(seed)
    shapes = fam.tiny.hf_shapes(fam.config_from_hf(config))
    tensors = {name: _tensor(fam.tiny.init, name, shape, generator) for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def hf_model(checkpoint: Path, architecture: str, eager: bool = True, **overrides: object):
    """transformers' `architecture` over the checkpoint in fp32 and eval mode (eager attention unless not
    `eager`; `overrides` replace config fields). A *ForCausalLM loads through AutoModelForCausalLM, so
    the checkpoint's config must name it."""
    import transformers

    loader = transformers.AutoModelForCausalLM if architecture.endswith("ForCausalLM") else None
    loader = loader or getattr(transformers, architecture)
    attention = {"attn_implementation": "eager"} if eager else {}
    model = loader.from_pretrained(str(checkpoint), dtype=torch.float32, **attention, **overrides)
    assert type(model).__name__ == architecture
    return model.eval()


def tiny_fixtures(family: str, recipe: str, architecture: str, eager: bool = True) -> tuple[Any, Any]:
    """A family test module's `tiny` fixture ((tiny checkpoint, its core with prompt logprobs), exported
    once) and `reference` fixture (transformers' `architecture` over it, as hf_model loads it):
    `tiny, reference = tiny_fixtures(...)`."""

    @pytest.fixture(scope="module")
    def tiny(tiny_cores: TinyCores) -> tuple[Path, Path]:
        return export_tiny(family, recipe, tiny_cores)

    @pytest.fixture(scope="module")
    def reference(tiny: tuple[Path, Path]):
        return hf_model(tiny[0], architecture, eager)

    return tiny, reference


# The YaRN rotary of the MLA families' test variants (512 positions over 64: factor 8; mscale !=
# mscale_all_dim, so cos/sin and the softmax scale both carry corrections).
MLA_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}

# The chat and long text the families' logprob checks prompt with (chat_prompts).
TERSE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? Answer in one word, please."},
]


def chat_prompts(
    core: Core, roles: Mapping[str, str], *texts: str, chat: list[dict[str, str]] = TERSE_CHAT
) -> list[list[int]]:
    """Token ids of `chat` as the core's template renders it (`roles`: its special tokens), then of each text."""
    from helios.core.template import ChatTemplate

    tok = core.tokenizer()
    rendered = ChatTemplate(core.chat_template(), dict(roles)).render(chat, add_generation_prompt=True)
    return [tok.encode(rendered, add_special_tokens=False).ids, *(tok.encode(text).ids for text in texts)]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' full-vocabulary logprobs [T, V] for one sequence."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def reference_error(family: str, checkpoint: Path, model, ids: list[int]) -> float:
    """Max |Δ| of the family's plain-torch reference logprobs (what the export self-check compares
    the programs against) on the checkpoint against transformers' model."""
    source, fam = open_source(str(checkpoint)), FAMILIES[family]
    logits = fam.reference.logits(fam.config_from_hf(source.hf_config), source.tensors, ids)
    return float((torch.log_softmax(logits, dim=-1) - hf_logprobs(model, ids)).abs().max())


def engine_logprob_error(core_dir: Path, model, prompts: list[list[int]], max_tokens: int = 12) -> float:
    """Max |Δ| of each greedy token's logprob and top alternatives, generated by the engine (16-token
    prefill chunks, then decode rows) for the prompts together, against transformers' on the whole sequence."""
    core = Core.open(core_dir)
    engine = build_engine(core, EngineConfig(num_pages=64, prefill_chunk_size=16))
    requests = [
        EngineRequest(f"g{i}", tuple(ids), (GREEDY,), max_tokens, ignore_eos=True, num_top_logprobs=3)
        for i, ids in enumerate(prompts)
    ]
    outputs = run_to_completion(engine, requests)
    worst = 0.0
    for request in requests:
        out = outputs[request.request_id][0]
        expected = hf_logprobs(model, list(request.prompt_ids) + out.token_ids)
        for step, entry in enumerate(out.logprobs):
            row = expected[len(request.prompt_ids) - 1 + step]
            worst = max(
                worst,
                abs(entry.logprob - float(row[entry.token_id])),
                *(abs(v - float(row[t])) for t, v in entry.alternatives),
            )
    return worst


def check_generation_matches(core_dir: Path, model, text: str, max_tokens: int) -> None:
    """Each greedy token's logprob and top alternatives equal transformers' on the whole sequence."""
    prompt = Core.open(core_dir).tokenizer().encode(text).ids
    assert engine_logprob_error(core_dir, model, [prompt], max_tokens) <= 1e-3


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
# Texts of several and of many 16-token chunks and pages, and eight plain prompts.
LONG_TEXT = TEXTS[0] + " " + TEXTS[3]
LONGER_TEXT = LONG_TEXT + " " + TEXTS[2]
EIGHT_PLAIN_TEXTS = [
    *TEXTS,
    "Water boils at one hundred degrees.",
    "1, 2, 3, 4, 5, 6, 7,",
    "Hello",
    "My favourite colour is",
]
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


def watch_topk_ties(
    monkeypatch: pytest.MonkeyPatch, watched: Callable[[torch.Tensor, int, int], bool]
) -> dict[str, int]:
    """Compares, row by row, the torch top-k calls `watched(scores, k, dim)` picks (an indexer's
    [B, S, T] scores in transformers) with the ops' selection rule applied to the same scores. They can
    differ only where an exact tie sits at the k-th score: torch.topk has no fixed order among ties,
    while the ops keep the earlier key (tests/engine/test_kernels_sparse.py). Counts rows that drop
    keys, rows with such a tie, and rows whose kept keys differ."""
    from helios.core.ops import sparse as ops_sparse

    seen = {"dropping": 0, "tied": 0, "differ": 0}
    topk = torch.Tensor.topk

    def counted(self: torch.Tensor, k: int, dim: int = -1, *args, **kwargs):
        out = topk(self, k, dim, *args, **kwargs)
        if watched(self, k, dim):
            scores = self.reshape(-1, self.shape[-1])
            visible = scores > torch.finfo(self.dtype).min / 2  # the causal mask adds finfo.min (or -inf)
            kth = out.values.reshape(-1, k)[:, -1:]
            dropping = visible.sum(-1) > k
            tied = dropping & (((scores > kth) & visible).sum(-1) + ((scores == kth) & visible).sum(-1) > k)
            kept = ops_sparse.selected_keys(out.indices.reshape(-1, k), scores.shape[-1]) & visible
            rule = ops_sparse.selected_keys(ops_sparse.select_topk(scores, visible, k), scores.shape[-1])
            seen["dropping"] += int(dropping.sum())
            seen["tied"] += int(tied.sum())
            seen["differ"] += int((kept != rule).any(-1).sum())
        return out

    monkeypatch.setattr(torch.Tensor, "topk", counted)
    return seen


# ---------------------------------------------------------------------------- served cores

# The tool-call round trips' request: ASK with a get_weather(city, days) tool; RESULT answers the call.
ASK, RESULT = "Weather in Paris?", "Sunny, 21 C"
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
# What tool_round_trip reads back from a scripted output reasoning, then writing, then calling get_weather.
WEATHER_CALL = {
    "reasoning": "The user wants weather.",
    "text": "Checking.",
    "calls": [("get_weather", {"city": "Paris", "days": 3})],
}
VERSION = {"anthropic-version": "2023-06-01"}
THINKING = {"type": "enabled", "budget_tokens": 1024}
DSML = "｜DSML｜"
# WEATHER_CALL's call as a DeepSeek V4 DSML block.
DSML_CALL = (
    f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)
# WEATHER_CALL as qwen3_coder-style tool syntax after a "<think>\n"-ended prompt (Nemotron-H, Step).
XML_CALL_OUTPUT = (
    "The user wants weather.\n</think>\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>"
)


def served(core_fixture: str = "tiny") -> Any:
    """A module-scoped `app` fixture: the core of the `core_fixture` fixture ((checkpoint, core, ...))
    served in process with a scripted model (tests/server/scripted.py): `app = served("tiny")`."""

    @pytest.fixture(scope="module")
    def app(request: pytest.FixtureRequest):
        from server.scripted import scripted_app  # tests/ is on sys.path

        with scripted_app(request.getfixturevalue(core_fixture)[1]) as server:
            yield server

    return app


def between_newlines(got: dict[str, Any]) -> dict[str, Any]:
    """tool_round_trip's reading with the newlines a "think" parser keeps around </think> (reasoning
    "...weather.\\n", text "\\nChecking.") stripped: what is between them."""
    return got | {"reasoning": got["reasoning"].strip("\n"), "text": got["text"].strip("\n")}


def check_think_tool_call(app, route: str, finish: str, check_prompt: Callable[[Any], None]) -> None:
    """XML_CALL_OUTPUT's reasoning and call come back in `route`'s shape, the newlines around </think>
    aside, with `finish`, from a prompt check_prompt(app) accepts."""
    app.say(XML_CALL_OUTPUT)
    got, reason = tool_round_trip(app, route, ASK, CITY)
    check_prompt(app)
    assert between_newlines(got) == WEATHER_CALL and reason == finish


def check_images_refused(app) -> None:
    """A text-only core (its vision tower not compiled) answers image parts with a client error."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {
        "model": "x",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, image]}],
    }
    response = app.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "does not accept images" in response.json()["error"]["message"]


def scripted_turn(app, path: str, body: dict, output: str, **kwargs) -> tuple[dict, str]:
    """One request to `path` the scripted model answers with `output`: (the response's JSON, the prompt it saw)."""
    app.say(output)
    response = app.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response.json(), app.last_prompt() or ""


# (route, its finish reason for a tool call) of each protocol tool_round_trip drives.
TOOL_ROUTES = (("chat", "tool_calls"), ("messages", "tool_use"), ("responses", "completed"))


def weather_request(route: str, ask: str = ASK, schema: dict = CITY, **extra) -> tuple[str, dict, dict]:
    """(path, body, headers) of a user turn `ask` offering a get_weather tool (`schema`) through `route`
    ("chat", "messages" or "responses"), `extra` added to the body."""
    if route == "chat":
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
        messages = [{"role": "user", "content": ask}]
        return (
            "/v1/chat/completions",
            {"model": "x", "messages": messages, "max_tokens": 256, "tools": tools, **extra},
            {},
        )
    if route == "messages":
        tools = [{"name": "get_weather", "input_schema": schema}]
        messages = [{"role": "user", "content": ask}]
        return "/v1/messages", {"model": "x", "max_tokens": 256, "messages": messages, "tools": tools, **extra}, VERSION
    assert route == "responses", route
    tools = [{"type": "function", "name": "get_weather", "parameters": schema}]
    return "/v1/responses", {"model": "x", "input": ask, "max_output_tokens": 256, "tools": tools, **extra}, {}


def read_turn(route: str, response: dict) -> dict[str, Any]:
    """A `route` response read the same way for every protocol: its "parts" in order ("reasoning",
    "text", "call"), the "reasoning" and "text", the "calls" [(name, arguments)] and the "finish" reason
    (or the Responses status)."""
    if route == "chat":
        choice = response["choices"][0]
        message = choice["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        ]
        reasoning, text = message.get("reasoning_content"), message["content"]
        parts = [part for part, value in (("reasoning", reasoning), ("text", text), ("call", calls)) if value]
        return {"parts": parts, "reasoning": reasoning, "text": text, "calls": calls, "finish": choice["finish_reason"]}
    if route == "messages":
        blocks, kinds = response["content"], {"thinking": "reasoning", "text": "text", "tool_use": "call"}
        return {
            "parts": [kinds[b["type"]] for b in blocks],
            "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "text": "".join(b["text"] for b in blocks if b["type"] == "text"),
            "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
            "finish": response["stop_reason"],
        }
    output, kinds = response["output"], {"reasoning": "reasoning", "message": "text", "function_call": "call"}
    return {
        "parts": [kinds[i["type"]] for i in output],
        "reasoning": "".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]),
        "text": "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"]),
        "calls": [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"],
        "finish": response["status"],
    }


def tool_round_trip(app, route: str, ask: str, schema: dict, **extra) -> tuple[dict, str]:
    """One user turn offering a get_weather tool through `route` ("chat", "messages" or "responses")
    of a scripted in-process server (tests/server/scripted.py), after app.say(...) scripted the
    model's output: ({"reasoning", "text", "calls": [(name, arguments)]}, finish reason or status)."""
    path, body, headers = weather_request(route, ask, schema, **extra)
    response = app.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    turn = read_turn(route, response.json())
    return {key: turn[key] for key in ("reasoning", "text", "calls")}, turn["finish"]


def tool_result_turns(app, route: str, first: str, final: str) -> tuple[dict, str, dict, str]:
    """Two turns through `route` (Messages with thinking on): ASK with the get_weather tool, answered
    by `first` (a call), then that reply and the call's RESULT in the history, answered by `final`:
    (first response, its prompt, final response, its prompt), the responses as JSON."""
    path, body, headers = weather_request(route, **({"thinking": THINKING} if route == "messages" else {}))
    reply, prompt = scripted_turn(app, path, body, first, headers=headers)
    if route == "chat":
        message = reply["choices"][0]["message"]
        (call,) = message["tool_calls"]
        answered = {"role": "assistant", "content": message["content"], "tool_calls": [call]}
        answered["reasoning_content"] = message["reasoning_content"]
        result = {"role": "tool", "tool_call_id": call["id"], "content": RESULT}
        body |= {"messages": [*body["messages"], answered, result]}
    elif route == "messages":
        (use,) = [b for b in reply["content"] if b["type"] == "tool_use"]
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": RESULT}]}
        body |= {"messages": [*body["messages"], {"role": "assistant", "content": reply["content"]}, result]}
    else:
        (call,) = [i for i in reply["output"] if i["type"] == "function_call"]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}
        body |= {"input": [{"role": "user", "content": ASK}, *reply["output"], result]}
    return reply, prompt, *scripted_turn(app, path, body, final, headers=headers)


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


def check_program_logprobs(
    core_dir: Path, model, prompts: list[list[int]], scored: list[list[int]] | None = None
) -> None:
    """The step program's logprobs on the prompts (prefilled whole, in chunks of 16 and 5, and token by
    token past the first page) and the scored-prefill program's prompt logprobs and top alternatives
    (page-sized chunks) on `scored` (the prompts by default) equal transformers' within 1e-3."""
    page = Core.open(core_dir).manifest.limits.page_tokens
    worst = step_logprob_error(core_dir, model, prompts, decoded=page + 4)
    print(f"max |Δ logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3
    worst = prompt_logprob_error(core_dir, model, prompts if scored is None else scored, chunk=page)
    print(f"max |Δ prompt logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3


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
