"""The reasoning budget's forced close (spec: thinking_token_budget): at the cap the engine writes
the close token only while reasoning is unambiguously open and the output grammar allows it. A
tool opener still waiting for the text that decides it, a call that ended reasoning, or a grammar
that masks the close leave generation alone; once the obstacle is gone the cap still holds.

The model is scripted (tests/support.py): its token choice is fixed, everything after the
executor (sampler, forced close, gate, parsers) is the production path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ScriptedExecutor

from helios.config import ServerConfig
from helios.core import Core
from helios.engine import EngineConfig, MaskHook, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.frontend.parsers.budget import tool_exits
from helios.frontend.request import Frontend
from helios.protocols import openai_chat
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import build_tokenizer, write_testmodel

DATA = Path(__file__).resolve().parents[1] / "data"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
Served = tuple[Core, Frontend]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """A tiny Qwen3 core with Qwen3.5's tokens and template (its prompt opens <think>) and
    function-tag tool calls, whose <tool_call> is decided by the text after it."""
    checkpoint = write_testmodel("qwen3", tmp_path_factory.mktemp("ckpt") / "coder", seed=3, chat="qwen3.5")
    out = tmp_path_factory.mktemp("cores") / "coder"
    export_core(open_source(str(checkpoint)), load_recipe(str(DATA / "tiny_qwen3_coder.toml")), ExportOptions(out=out))
    core = Core.open(out, verify_checksums=False)
    return core, Frontend(core, ServerConfig())


def _request(frontend: Frontend, budget: int, **fields: Any) -> EngineRequest:
    body = {"model": "x", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 256, **fields}
    prepared = frontend.prepare(openai_chat.decode({**body, "thinking_token_budget": budget})[0], "r")
    engine = prepared.inputs[0].engine
    assert engine is not None and engine.reasoning_budget is not None
    return replace(engine, params=engine.params[:1])


def _ids(frontend: Frontend, *parts: str) -> list[int]:
    """Each part tokenized on its own, so a delimiter spelling that is a token is that token."""
    return [t for part in parts for t in frontend.tokenizer.encode(part, add_special_tokens=False).ids]


def _run(served: Served, request: EngineRequest, script: list[int], mask_hook: MaskHook | None = None) -> list[int]:
    """The choice's tokens (its EOS dropped) with `script` as the model's choice: a forced close
    takes the place of the scripted token at its position."""
    core, frontend = served
    engine = build_engine(core, EngineConfig(num_pages=64), mask_hook=mask_hook)
    scripted = ScriptedExecutor(engine.executor, eos_id=core.manifest.tokenizer.eos_token_ids[0])
    scripted.script(script)
    engine.executor = scripted
    (choice,) = run_to_completion(engine, [request])[request.request_id]
    assert choice.finish is FinishCause.EOS, choice.error
    assert engine.stats.reasoning_budget_cuts == choice.token_ids.count(frontend.tokenizer.token_to_id("</think>"))
    return list(choice.token_ids[:-1])


def test_the_close_waits_while_a_tool_opener_is_undecided(served: Served) -> None:
    """The cap falls right after <tool_call>: whether it starts a call depends on what follows.
    Read as prose, reasoning is open again and the close comes at once; read as a call, reasoning
    ended with it and nothing is forced."""
    _, frontend = served
    close = frontend.tokenizer.token_to_id("</think>")
    lead = _ids(frontend, "ab", "<tool_call>")  # the budget: the opener is the cap's last token
    request = _request(frontend, len(lead), tools=[WEATHER])
    assert request.reasoning_budget is not None and request.reasoning_budget.gate is not None
    prose = _ids(frontend, "x", " is a tag")  # "x" (one token) cannot begin <function=: prose
    tokens = _run(served, request, lead + prose + _ids(frontend, "Answer."))
    assert tokens[: len(lead) + 1] == lead + prose[:1]  # undecided after the opener: no close
    assert tokens[len(lead) + 1] == close  # "x" decided it is prose: the cap applies
    call = _ids(frontend, CALL, "</tool_call>")
    assert _run(served, request, lead + call) == lead + call  # a call ended reasoning: never forced


def test_an_opener_is_reasoning_text_when_tools_are_off(served: Served) -> None:
    """Without tools the parser reads no calls: <tool_call> is reasoning like any other token."""
    _, frontend = served
    lead = _ids(frontend, "ab", "<tool_call>")
    request = _request(frontend, len(lead))
    assert request.reasoning_budget is not None and request.reasoning_budget.gate is None
    tokens = _run(served, request, lead + _ids(frontend, " tag", "Answer."))
    assert tokens[: len(lead) + 1] == [*lead, frontend.tokenizer.token_to_id("</think>")]


def test_the_close_waits_while_the_grammar_masks_it(served: Served) -> None:
    """A grammar mask without the close token at the cap: no forced close (which the grammar
    would then reject, failing the choice); the cut comes once the mask admits it."""
    _, frontend = served
    close = frontend.tokenizer.token_to_id("</think>")
    vocab = frontend.vocab_size
    opened_at = 4  # output length from which the mask admits the close

    def masks(rows) -> torch.Tensor:
        allowed = torch.ones(len(rows), vocab, dtype=torch.bool)
        for index, row in enumerate(rows):
            if len(row.token_ids) - row.num_prompt < opened_at:
                allowed[index, close] = False
        return allowed

    request = _request(frontend, 2)
    script = _ids(frontend, "ab", " is", " a", " tag", " here", "Answer.")
    tokens = _run(served, request, script, mask_hook=masks)
    assert close not in tokens[:opened_at] and tokens[opened_at] == close
    assert tokens[:opened_at] == script[:opened_at]


def test_tool_exits_by_syntax() -> None:
    """Which tool openers end reasoning at once, and which wait for a decision (by gate)."""
    tokenizer = build_tokenizer(("<think>", "</think>", "<tool_call>", "</tool_call>", "｜DSML｜"))
    assert tool_exits(tokenizer, "deepseek_dsml_v4", ()) == (frozenset((tokenizer.token_to_id("｜DSML｜"),)), None)
    for syntax in ("qwen3_coder", "mimo", "hermes"):  # their openers count in reasoning
        implicit, gate = tool_exits(tokenizer, syntax, ())
        assert implicit == frozenset() and gate is not None
    for syntax in ("glm47", "gemma4", "minimax_m3", "kimi3"):  # openers in reasoning are reasoning text
        assert tool_exits(tokenizer, syntax, ()) == (frozenset(), None)
    _, hermes = tool_exits(tokenizer, "hermes", ())
    _, coder = tool_exits(tokenizer, "qwen3_coder", ())
    assert hermes is not None and coder is not None
    ids = tokenizer.encode("plan ", add_special_tokens=False).ids + [tokenizer.token_to_id("<tool_call>")]
    assert not hermes.fork().allows_close(ids, 0)  # Hermes' opener always starts a call
    assert not coder.fork().allows_close(ids, 0)  # undecided
    text = tokenizer.encode(" is a tag", add_special_tokens=False).ids
    gate = coder.fork()
    assert not gate.allows_close([7, *ids], 1) and gate.allows_close([7, *ids, *text], 1)
    # A partly written text opener (no <tool_call> token in this vocabulary) is undecided too.
    plain = build_tokenizer(("<think>", "</think>"))
    _, text_gate = tool_exits(plain, "qwen3_coder", ())
    assert text_gate is not None
    assert not text_gate.fork().allows_close(plain.encode("plan <tool_", add_special_tokens=False).ids, 0)
    assert text_gate.fork().allows_close(plain.encode("plan <tool_call> is a tag", add_special_tokens=False).ids, 0)
