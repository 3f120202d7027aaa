"""Issue 43 through the server, the rest of its list: at --tensor-parallel 2 with the prefix cache and
speculation on (history drafts offered every round), the four generation protocols, structured output,
prefix reuse and speculation answer as one rank with both off (greedy, top_k 1). Slow (two servers):
FLARE_SLOW_TESTS=1."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tp_support import SLOW, RankServer, free_port, tp_llama_core

__all__ = ["tp_llama_core"]  # session fixture
pytestmark = SLOW
GREEDY = {"temperature": 0, "top_k": 1}  # the recipe clamps temperature 0 to 0.01, which still samples
# Repeats, so that history drafts are offered and accepted.
REPEAT = "one two three four five six seven eight " * 6


def _config(tmp: Path, name: str, features: bool) -> Path:
    path = tmp / f"{name}.toml"
    speculation = '"fixed"' if features else '"off"'
    path.write_text(
        f"[server]\nserial_decode_rows = 0\nspeculation = {speculation}\nprefix_cache = {str(features).lower()}\n"
        "kv_pages = 256\n[parallel]\ntimeout_s = 30\n"
    )
    return path


@pytest.fixture(scope="module")
def servers(tp_llama_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RankServer, RankServer]]:
    tmp = tmp_path_factory.mktemp("tp-features")
    two = RankServer(
        tp_llama_core,
        tmp / "tp2.log",
        "--tensor-parallel",
        "2",
        "--master-port",
        str(free_port()),
        "--config",
        str(_config(tmp, "tp2", True)),
    )
    try:
        one = RankServer(tp_llama_core, tmp / "tp1.log", "--config", str(_config(tmp, "tp1", False)))
        try:
            yield two, one
        finally:
            one.stop()
    finally:
        two.stop()


def _post(server: RankServer, path: str, body: dict) -> dict:
    headers = {"anthropic-version": "2023-06-01"}  # read by /v1/messages only
    response = httpx.post(server.url + path, json=body, headers=headers, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def _both(servers: tuple[RankServer, RankServer], path: str, body: dict) -> tuple[dict, dict]:
    two, one = servers
    return _post(two, path, body), _post(one, path, body)


def test_chat_and_completions_with_logprobs(servers: tuple[RankServer, RankServer]) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 24}
    got, want = _both(servers, "/v1/chat/completions", {**chat, **GREEDY, "logprobs": True, "top_logprobs": 3})
    got_entries, want_entries = (r["choices"][0]["logprobs"]["content"] for r in (got, want))
    assert [e["bytes"] for e in got_entries] == [e["bytes"] for e in want_entries]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(got_entries, want_entries)) < 1e-4
    completion = {"model": "m", "prompt": REPEAT, "max_tokens": 32, "ignore_eos": True, "logprobs": 1, **GREEDY}
    got, want = _both(servers, "/v1/completions", completion)
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]


def test_messages_and_responses(servers: tuple[RankServer, RankServer]) -> None:
    messages = {"model": "m", "max_tokens": 24, "messages": [{"role": "user", "content": "Name a colour."}], **GREEDY}
    got, want = _both(servers, "/v1/messages", messages)
    assert got["content"] == want["content"] and got["usage"]["output_tokens"] == want["usage"]["output_tokens"]
    responses = {"model": "m", "input": "Name a colour.", "max_output_tokens": 24, **GREEDY}
    got, want = _both(servers, "/v1/responses", responses)
    assert got["status"] == want["status"] and got["usage"]["output_tokens"] == want["usage"]["output_tokens"]
    texts = [
        [c["text"] for item in r["output"] if item["type"] == "message" for c in item["content"]] for r in (got, want)
    ]
    assert texts[0] == texts[1]


def test_structured_output(servers: tuple[RankServer, RankServer]) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Give a number."}],
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        **GREEDY,
    }
    got, want = _both(servers, "/v1/chat/completions", body)
    text = got["choices"][0]["message"]["content"]
    assert text == want["choices"][0]["message"]["content"]
    if got["choices"][0]["finish_reason"] == "stop":
        assert re.fullmatch(r'\{\s*"n"\s*:\s*-?\d+\s*\}', text), text


def test_prefix_reuse_and_speculation(servers: tuple[RankServer, RankServer]) -> None:
    two, one = servers
    body = {"model": "m", "prompt": REPEAT + "and again:", "max_tokens": 48, "ignore_eos": True, **GREEDY}
    first = _post(two, "/v1/completions", body)
    again = _post(two, "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    want = _post(one, "/v1/completions", body)
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == want["choices"][0]["text"]
    metrics = httpx.get(two.url + "/metrics", timeout=30).text
    offered = re.search(r"^flare_verification_draft_tokens_total (\S+)$", metrics, re.M)
    assert offered is not None and float(offered.group(1)) > 0  # drafts were verified at TP=2
