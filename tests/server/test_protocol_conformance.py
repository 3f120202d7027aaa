"""Protocol conformance over HTTP (issue 23): raw completions, usage streams, token observations,
error shapes, Messages extensions and Responses identity, each checked against spec/api.md.

The real tiny core serves most cases; a scripted model (tests/server/scripted.py) writes the
output where a case needs exact tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from scripted import ScriptedServer, scripted_app
from serving import Server, schema_validator, sse_events

from helios.protocols import anthropic_messages, openai_chat, openai_completions
from helios.protocols.openai_responses import decode as responses_decode

VERSION = {"anthropic-version": "2023-06-01"}
ASK = [{"role": "user", "content": "Say hello."}]
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # ten prompt positions
CHUNK = 4  # the scripted server's prefill_chunk_size


def _chunks(response) -> list[dict]:
    events = sse_events(response)
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def plain(tiny_core: Path) -> Iterator[ScriptedServer]:
    """The tiny core (prompt logprobs on), scripted output, small prefill chunks."""
    with scripted_app(tiny_core, prefill_chunk_size=CHUNK) as server:
        yield server


@pytest.fixture(scope="module")
def qwen(qwen3_core: Path) -> Iterator[ScriptedServer]:
    with scripted_app(qwen3_core) as server:
        yield server


def _ids(server: ScriptedServer, text: str) -> list[int]:
    return server.state.frontend.tokenizer.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------- raw completions
@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3], [4, 5]]])
def test_token_id_prompt_echo_scores_without_generating(server: Server, prompt: list) -> None:
    """Token-id prompts echo their decoded text, with prompt entries, at max_tokens 0."""
    response = server.post(
        "/v1/completions", {"model": "x", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    prompts = prompt if isinstance(prompt[0], list) else [prompt]
    assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
    for choice, ids in zip(body["choices"], prompts):
        assert choice["finish_reason"] == "length" and choice["text"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert all(value is not None for value in lp["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0


def test_batched_seeds_advance_by_global_choice_index(server: Server) -> None:
    """Choice prompt_index * n + j samples with seed + that index, as a lone request would."""
    common = {"model": "x", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    batched = server.post("/v1/completions", {**common, "prompt": ["Hello", "Hello"], "n": 2, "seed": 5}).json()
    texts = [c["text"] for c in batched["choices"]]
    alone = [
        server.post("/v1/completions", {**common, "prompt": "Hello", "seed": 5 + k}).json()["choices"][0]["text"]
        for k in range(4)
    ]
    assert texts == alone
    assert texts[2:] != texts[:2]  # the second prompt does not repeat the first one's samples


def test_streamed_echo_sends_a_frame_per_prompt_chunk(plain: ScriptedServer) -> None:
    """Streaming echo: one logprob frame per completed prompt chunk, before generated entries."""
    plain.say(" ok")
    body = {"model": "x", "prompt": PROMPT_IDS, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    chunks = _chunks(plain.post("/v1/completions", json=body))
    frames = [c["choices"][0] for c in chunks]
    sizes = [len(f["logprobs"]["tokens"]) for f in frames if f["logprobs"]]
    assert sizes[:3] == [4, 4, 2], sizes  # prefill chunks of 4 positions over a 10-token prompt
    prompt_frames = frames[:3]
    assert prompt_frames[0]["logprobs"]["token_logprobs"][0] is None
    assert all(f["finish_reason"] is None for f in prompt_frames)
    assert prompt_frames[0]["text"] and not prompt_frames[1]["text"] and not prompt_frames[2]["text"]
    offsets = [o for f in frames if f["logprobs"] for o in f["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets)
    plain.say(" ok")
    buffered = plain.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    assert "".join(f["text"] for f in frames) == buffered["text"]


# ---------------------------------------------------------------------------- usage while streaming
def test_continuous_usage_on_every_chat_chunk(server: Server) -> None:
    body = {
        "model": "x",
        "messages": ASK,
        "max_tokens": 5,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _chunks(server.post("/v1/chat/completions", body))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # every chunk, the role chunk included
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_continuous_usage_on_every_completion_chunk(server: Server) -> None:
    body = {
        "model": "x",
        "prompt": ["Hello there", "The sea"],
        "n": 2,
        "max_tokens": 4,
        "echo": True,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _chunks(server.post("/v1/completions", body))
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 16
    echoed = _chunks(server.post("/v1/completions", {**body, "max_tokens": 0}))  # echo frames only, no generation
    assert len(echoed) == 5 and all(c["usage"]["completion_tokens"] == 0 for c in echoed)
    ignored = _chunks(server.post("/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}}))
    assert not any("usage" in c for c in ignored)  # ignored without include_usage


# ---------------------------------------------------------------------------- token observations
def test_token_timestamps_buffered(server: Server) -> None:
    before = time.time()
    body = server.post(
        "/v1/chat/completions",
        {
            "model": "x",
            "messages": ASK,
            "max_tokens": 4,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_token_timestamps": True,
        },
    ).json()
    after = time.time()
    choice = body["choices"][0]
    stamps = choice["token_timestamps"]
    assert len(stamps) == len(choice["token_ids"]) == 4
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    alone = server.post(
        "/v1/chat/completions", {"model": "x", "messages": ASK, "max_tokens": 2, "return_token_timestamps": True}
    ).json()
    assert "token_timestamps" in alone["choices"][0] and "token_ids" not in alone["choices"][0]


def test_token_ids_stream_puts_usage_on_the_terminal_chunk(server: Server, openai_schema: dict) -> None:
    validator = schema_validator(openai_schema, "CreateChatCompletionStreamResponse")
    body = {
        "model": "x",
        "messages": ASK,
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_token_timestamps": True,
    }
    chunks = _chunks(server.post("/v1/chat/completions", body))
    for chunk in chunks:
        validator.validate(chunk)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    stamps = [t for c in chunks for t in c["choices"][0].get("token_timestamps", [])]
    assert len(ids) == len(stamps) == 4
    terminal = chunks[-1]
    assert terminal["choices"][0]["finish_reason"] == "length"
    usage = terminal["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert "reasoning_tokens" in usage["completion_tokens_details"]
    assert not any("usage" in c for c in chunks[:-1])


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "x", "messages": ASK, "logprobs": True, "top_logprobs": 30}),
        ("/v1/completions", {"model": "x", "prompt": "hi", "best_of": 3}),
        ("/v1/responses", {"model": "x", "input": "hi", "store": True}),
    ],
)
def test_openai_errors_have_a_null_param(server: Server, openai_schema: dict, path: str, body: dict) -> None:
    response = server.post(path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    schema_validator(openai_schema, "ErrorResponse").validate(response.json())
    assert set(error) == {"type", "message", "param", "code"} and error["param"] is None
    assert error["type"] == "invalid_request_error" and error["message"]


# ---------------------------------------------------------------------------- responses
def test_responses_identify_the_loaded_model(server: Server) -> None:
    buffered = server.post("/v1/responses", {"model": "some-client-name", "input": "hi", "max_output_tokens": 3})
    assert buffered.status_code == 200 and buffered.json()["model"] == "tiny-alias"
    events = [
        json.loads(e)
        for e in sse_events(
            server.post(
                "/v1/responses", {"model": "some-client-name", "input": "hi", "max_output_tokens": 3, "stream": True}
            )
        )
    ]
    assert {e["response"]["model"] for e in events if "response" in e} == {"tiny-alias"}


# ---------------------------------------------------------------------------- messages extensions
def _message(server: ScriptedServer, **fields) -> dict:
    response = server.post(
        "/v1/messages", headers=VERSION, json={"model": "claude-x", "max_tokens": 12, "messages": ASK, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_messages_ignore_eos_and_token_stops(plain: ScriptedServer) -> None:
    plain.say("Hello there friend")
    assert _message(plain)["stop_reason"] == "end_turn"
    plain.say("Hello there friend")
    kept = _message(plain, ignore_eos=True)
    assert kept["stop_reason"] == "max_tokens" and kept["usage"]["output_tokens"] == 12
    ids = _ids(plain, "Hello there friend")
    plain.say("Hello there friend")
    stopped = _message(plain, stop_token_ids=[ids[1]])
    assert stopped["stop_reason"] == "end_turn" and stopped["usage"]["output_tokens"] == 2
    assert "".join(b["text"] for b in stopped["content"]) == plain.state.frontend.tokenizer.decode(ids[:1])
    plain.say("Hello there friend")
    sequence = _message(plain, stop_token_sequences=[ids[1:3]])
    assert sequence["stop_reason"] == "end_turn" and sequence["usage"]["output_tokens"] == 3
    mixed = plain.post(
        "/v1/messages",
        headers=VERSION,
        json={"model": "m", "max_tokens": 4, "messages": ASK, "stop_sequences": ["x"], "stop_token_ids": [ids[0]]},
    )
    assert mixed.status_code == 400 and mixed.json()["type"] == "error"


def test_messages_chat_template_kwargs_reach_the_template(qwen: ScriptedServer) -> None:
    qwen.say("Hi.")
    _message(qwen)
    default = qwen.last_prompt()
    qwen.say("Hi.")
    _message(qwen, chat_template_kwargs={"enable_thinking": False})
    assert qwen.last_prompt() != default and qwen.last_prompt().endswith("<think>\n\n</think>\n\n")
    counted = qwen.post(
        "/v1/messages/count_tokens",
        headers=VERSION,
        json={"model": "m", "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert counted["input_tokens"] == len(_ids(qwen, qwen.last_prompt()))


TOOL_TURNS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
]


def _tool_result(**fields) -> list[dict]:
    block = {"type": "tool_result", "tool_use_id": "t1", "content": "city not found", **fields}
    return TOOL_TURNS + [{"role": "user", "content": [block]}]


def test_messages_tool_result_errors_reach_the_prompt(qwen: ScriptedServer) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
    qwen.say("Sorry.")
    _message(qwen, tools=tools, messages=_tool_result())
    ok = qwen.last_prompt()
    qwen.say("Sorry.")
    _message(qwen, tools=tools, messages=_tool_result(is_error=True))
    failed = qwen.last_prompt()
    assert "city not found" in failed and failed != ok


def test_image_in_tool_result_is_refused_on_text_only_cores(qwen: ScriptedServer) -> None:
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    response = qwen.post(
        "/v1/messages",
        headers=VERSION,
        json={
            "model": "m",
            "max_tokens": 4,
            "messages": _tool_result(content=[{"type": "text", "text": "chart:"}, image]),
        },
    )
    assert response.status_code == 400 and "image" in response.json()["error"]["message"]


# ---------------------------------------------------------------------------- work off the event loop
GRAMMAR_TOOL = {
    "type": "custom",
    "name": "ticket",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]+-[0-9]+"},
}


def test_decoding_and_tool_grammars_run_on_the_frontend_pool(plain: ScriptedServer, monkeypatch) -> None:
    """Request decoding (and the custom-tool grammar compile inside it) runs on the bounded
    frontend pool; tool grammars come from the shared cache."""
    threads: dict[str, str] = {}

    def recording(name, decode):
        def wrapped(*args, **kwargs):
            threads[name] = threading.current_thread().name
            return decode(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(openai_chat, "decode", recording("chat", openai_chat.decode))
    monkeypatch.setattr(openai_completions, "decode", recording("completions", openai_completions.decode))
    monkeypatch.setattr(anthropic_messages, "decode", recording("messages", anthropic_messages.decode))
    grammars = plain.state.frontend.grammars
    compiled = []
    real = grammars.tool_grammar

    def tool_grammar(*args):
        threads["grammar"] = threading.current_thread().name
        compiled.append(real(*args))
        return compiled[-1]

    monkeypatch.setattr(grammars, "tool_grammar", tool_grammar)
    plain.say("a")
    plain.post("/v1/chat/completions", json={"model": "x", "messages": ASK, "max_tokens": 1})
    plain.say("a")
    plain.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 1})
    plain.say("a")
    plain.post("/v1/messages", headers=VERSION, json={"model": "x", "messages": ASK, "max_tokens": 1})
    for _ in range(2):
        plain.say("a")
        response = plain.post(
            "/v1/responses", json={"model": "x", "input": "hi", "max_output_tokens": 1, "tools": [GRAMMAR_TOOL]}
        )
        assert response.status_code == 200, response.text
    assert set(threads) == {"chat", "completions", "messages", "grammar"}
    assert all(name.startswith("helios-frontend") for name in threads.values()), threads
    assert len(compiled) == 2 and compiled[0] is compiled[1]  # the second request hit the cache
    assert compiled[0].matches("ABC-12") and not compiled[0].matches("abc")


def test_responses_decode_compiles_with_the_given_compiler() -> None:
    seen = []

    def compiler(syntax, definition, field):
        seen.append((syntax, definition, field))
        from helios.frontend.grammar import compile_grammar

        return compile_grammar(syntax, definition, field)

    _, options = responses_decode({"model": "m", "input": "hi", "tools": [GRAMMAR_TOOL]}, grammars=compiler)
    assert seen == [("regex", "[A-Z]+-[0-9]+", "tools[0].format")] and options.custom_tools["ticket"] is not None
