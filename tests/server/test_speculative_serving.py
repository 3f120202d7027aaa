"""Speculation on the real SmolLM2 core through Chat Completions: 20 requests (repeat-after-me
prompts where drafts are accepted, plain chats, stop strings, JSON-schema grammars, n = 2) give
the same text, finish reasons and usage with speculation off, adaptive and fixed-width; the
speculative counters show drafts were verified and accepted."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from live import live_server, metrics

from helios.config import ServerConfig

# Three servers over 20 chats (about 70 s of a CI worker): with FLARE_SLOW_TESTS=1. In CI the engine's
# own speculation tests (tests/engine/test_speculative.py) check the same equality without HTTP.
pytestmark = pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow."
)
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _bodies() -> list[dict]:
    repeat = [
        f"Repeat this text exactly, nothing else:\n\n{PASSAGE}",
        f"Copy this code exactly:\n\n{CODE}",
        f"Say this twice: {PASSAGE[:60]}",
        "Count from one to twenty in words, separated by commas.",
    ]
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Name three primary colors.",
        "Explain recursion in one sentence.",
        "What is 12 times 12?",
        "Give me a short greeting.",
    ]
    bodies = [{"messages": [{"role": "user", "content": text}]} for text in repeat + chats]
    bodies += [
        {"messages": [{"role": "user", "content": f"Repeat exactly: {PASSAGE}"}], "stop": [stop]}
        for stop in ("zebras", "box", ". ")
    ]
    bodies += [
        {
            "messages": [{"role": "user", "content": f"Weather for a trip to {city}, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
        }
        for city in ("Paris", "Oslo", "Lima")
    ]
    bodies += [
        {"messages": [{"role": "user", "content": text}], "n": 2, "temperature": 0.8}
        for text in (f"Repeat: {PASSAGE}", "Tell me a fact about cats.")
    ]
    bodies.append({"messages": [{"role": "user", "content": f"Repeat: {CODE}"}], "presence_penalty": 0.5})
    bodies.append(
        {"messages": [{"role": "user", "content": f"Repeat: {PASSAGE}"}], "logprobs": True, "top_logprobs": 2}
    )
    assert len(bodies) == 20
    return [{"model": "x", "max_tokens": 40, "seed": 11, **body} for body in bodies]


def _answers(core: Path, **settings) -> tuple[list[dict], dict]:
    # Each run starts from an empty prefix cache (no host store shared across the runs), so their usage compares too.
    config = ServerConfig(kv_pages=512, host_cache=False, **settings)
    with live_server(core, config) as (url, _):
        answers = []
        for body in _bodies():
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            data = response.json()
            answers.append(
                {
                    "choices": [
                        (
                            c["message"]["content"],
                            c["finish_reason"],
                            [(t["token"], t["logprob"]) for t in (c.get("logprobs") or {}).get("content") or []],
                        )
                        for c in data["choices"]
                    ],
                    "usage": data["usage"],
                }
            )
        return answers, metrics(url)


@pytest.fixture(scope="module")
def plain(smollm2_core: Path) -> list[dict]:
    return _answers(smollm2_core, speculation="off")[0]


@pytest.mark.parametrize("mode", ["adaptive", "fixed"])
def test_same_answers_with_speculation(smollm2_core: Path, plain: list[dict], mode: str) -> None:
    answers, counters = _answers(smollm2_core, speculation=mode, max_draft_tokens=5)
    for index, (a, b) in enumerate(zip(plain, answers, strict=True)):
        assert a["usage"] == b["usage"], f"request {index}: usage differs"
        for (text, finish, logprobs), (text2, finish2, logprobs2) in zip(a["choices"], b["choices"], strict=True):
            assert (text, finish) == (text2, finish2), f"request {index} differs"
            assert [t for t, _ in logprobs] == [t for t, _ in logprobs2]
            assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(logprobs, logprobs2))
    assert counters["draft_rounds"] > 0 and counters["accepted_drafts"] > 0
    assert counters["verification_drafts"] >= counters["accepted_drafts"]
    assert counters["history_drafts_enabled"] == 1
