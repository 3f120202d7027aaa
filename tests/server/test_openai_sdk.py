"""OpenAI routes driven by the official SDK (strict validation) and checked against the OpenAPI schema."""

from __future__ import annotations

import json

import openai
import pytest
from serving import API_KEY, Server, schema_validator, sse_events


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, _strict_response_validation=True, max_retries=0)


@pytest.fixture(scope="module")
def validators(openai_schema):
    names = (
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "ListModelsResponse",
        "Model",
        "ErrorResponse",
    )
    return {name: schema_validator(openai_schema, name) for name in names}


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def test_models_route(server: Server, client: openai.OpenAI, validators) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-alias"]
    raw = server.get("/v1/models").json()
    validators["ListModelsResponse"].validate(raw)
    card = raw["data"][0]
    assert card["root"] == "tiny-llama" and card["owned_by"] == "local" and card["parent"] is None
    assert card["flare"]["max_top_logprobs"] == 20 and card["flare"]["sampling_ranges"]["temperature"] == {
        "min": 0.01,
        "max": 2.0,
    }
    assert card["permission"][0]["allow_logprobs"] is True
    for name in ("tiny-llama", "tiny-alias", "org/tiny"):
        assert client.models.retrieve(name).id == "tiny-alias"
    missing = server.get("/v1/models/nope/really")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_buffered_with_logprobs_and_n(server: Server, client: openai.OpenAI, validators) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="anything",
        messages=MESSAGES,
        max_tokens=6,
        n=3,
        seed=7,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    body = json.loads(raw.text)
    validators["CreateChatCompletionResponse"].validate(body)
    assert raw.headers["x-request-id"] == body["id"]
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.content) == 6
        for entry in choice.logprobs.content:
            assert len(entry.top_logprobs) == 3 and bytes(entry.bytes)
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
    usage = completion.usage
    assert usage.completion_tokens == 18 and usage.total_tokens == usage.prompt_tokens + 18
    assert usage.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=6, n=3, seed=7, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in completion.choices]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt's full pages were reused


def test_chat_stream_validates_every_chunk(server: Server, client: openai.OpenAI, validators) -> None:
    body = {
        "model": "x",
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    response = server.post("/v1/chat/completions", body)
    assert response.headers["content-type"].startswith("text/event-stream") and "x-request-id" in response.headers
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        validators["CreateChatCompletionStreamResponse"].validate(chunk)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    entries = [e for c in chunks[1:-1] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == 5
    usages = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert usages == sorted(usages) and usages[-1] == 5  # continuous usage is cumulative
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=5, stream=True, seed=3, extra_body={"ignore_eos": True}
        )
        if c.choices
    )
    buffered = (
        client.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=5, seed=3, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .message.content
    )
    assert streamed == buffered


def test_chat_prompt_logprobs_and_stops(server: Server, client: openai.OpenAI, validators) -> None:
    request = {"model": "x", "messages": MESSAGES, "max_tokens": 12, "seed": 11, "temperature": 0.01}
    full = client.chat.completions.create(**request, extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    prompt_logprobs = full.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(len(entry) >= 1 for entry in prompt_logprobs[1:])
    text = full.choices[0].message.content
    stop = text[3:5]
    if stop and stop.strip():
        stopped = client.chat.completions.create(**request, stop=[stop], extra_body={"ignore_eos": True})
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_completions_buffered_echo_logprobs_batch(server: Server, client: openai.OpenAI, validators) -> None:
    plain = client.completions.create(
        model="x",
        prompt=["Hello there", "The sea"],
        max_tokens=4,
        n=2,
        echo=True,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in plain.choices] == [0, 1, 2, 3]
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[2].text.startswith("The sea")
    assert plain.usage.completion_tokens == 16
    # Echo with logprobs puts null at prompt position 0 (spec/api.md), which the SDK's strict
    # models reject; the raw body is checked against the schema for everything else.
    raw = server.post(
        "/v1/completions",
        {
            "model": "x",
            "prompt": ["Hello there", "The sea"],
            "max_tokens": 4,
            "n": 2,
            "echo": True,
            "logprobs": 2,
            "seed": 5,
            "ignore_eos": True,
        },
    )
    body = raw.json()
    validators["CreateCompletionResponse"].validate(_without_echo_nulls(body))
    assert [c["text"] for c in body["choices"]] == [c.text for c in plain.choices]  # same seeds, same samples
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and "".join(lp["tokens"]) == body["choices"][0]["text"]
    unechoed = client.completions.create(
        model="x", prompt="Hello there", max_tokens=4, logprobs=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert len(unechoed.choices[0].logprobs.tokens) == 4


def test_echo_text_offsets_count_decoded_characters(server: Server) -> None:
    """api.md: prompt text_offset counts characters of the decoded token strings, whatever the
    token strings are shown as (token_id:N here), and generated offsets start after the echoed text."""
    body = {"model": "x", "prompt": "Hello there", "max_tokens": 4, "echo": True, "logprobs": 1, "seed": 5}
    plain = server.post("/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]
    as_ids = server.post("/v1/completions", {**body, "ignore_eos": True, "return_tokens_as_token_ids": True}).json()[
        "choices"
    ][0]
    offsets = as_ids["logprobs"]["text_offset"]
    assert as_ids["logprobs"]["tokens"][0].startswith("token_id:")
    assert offsets == plain["logprobs"]["text_offset"] and offsets == sorted(offsets)
    prompt_tokens = len(offsets) - 4
    assert offsets[prompt_tokens - 1] < len("Hello there") == offsets[prompt_tokens]  # generated after the echo
    assert offsets[0] == 0


def test_echo_arrays_follow_logprobs_and_the_field_prompt_logprobs(server: Server) -> None:
    """logprobs controls the echoed arrays' alternatives, prompt_logprobs the field's."""
    body = {"model": "x", "prompt": "Hello there", "max_tokens": 2, "echo": True, "logprobs": 5, "prompt_logprobs": 1}
    body["return_tokens_as_token_ids"] = True  # one key per id: several ids may decode to one string
    choice = server.post("/v1/completions", body).json()["choices"][0]
    prompt_tokens = len(choice["prompt_logprobs"])
    echoed = choice["logprobs"]["top_logprobs"][1:prompt_tokens]
    assert echoed and all(len(top) >= 5 for top in echoed)  # five alternatives (and the actual token)
    assert all(1 <= len(entry) <= 2 for entry in choice["prompt_logprobs"][1:])  # one alternative (and the actual)


def _without_echo_nulls(body: dict) -> dict:
    """spec/api.md: echoed position 0 has null token_logprobs/top_logprobs, which the OpenAI
    schema's arrays do not allow; validate everything else."""
    copy = json.loads(json.dumps(body))
    for choice in copy["choices"]:
        lp = choice.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][1:]
    return copy


def test_completions_stream_and_token_prompts(server: Server, validators) -> None:
    body = {
        "model": "x",
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 3,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(server.post("/v1/completions", body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks[:-1]:
        # OpenAI streams finish_reason null until a choice ends; its schema only lists the final values.
        choice = chunk["choices"][0]
        patched = {**chunk, "choices": [{**choice, "finish_reason": choice["finish_reason"] or "stop"}]}
        validators["CreateCompletionResponse"].validate(patched)
    finished = {c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"] == "length"}
    assert finished == {0, 1} and chunks[-1]["usage"]["completion_tokens"] == 6


def test_max_tokens_zero_tokenizes_only(server: Server) -> None:
    body = server.post("/v1/completions", {"model": "x", "prompt": "abc", "max_tokens": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    scored = server.post(
        "/v1/completions", {"model": "x", "prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 1}
    ).json()
    assert scored["choices"][0]["logprobs"]["token_logprobs"][1] is not None


def test_explicit_logprob_token_ids(server: Server, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="x",
        messages=MESSAGES,
        max_tokens=2,
        logprobs=True,
        extra_body={"logprob_token_ids": [7, 3, 7, 9], "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    for entry in out.choices[0].logprobs.content:
        ids = [t.token for t in entry.top_logprobs]
        assert ids[:3] == ["token_id:7", "token_id:3", "token_id:9"] and entry.token.startswith("token_id:")


def test_completions_streamed_echo_equals_buffered(server: Server) -> None:
    body = {
        "model": "x",
        "prompt": "Hello there",
        "max_tokens": 5,
        "echo": True,
        "logprobs": 1,
        "seed": 9,
        "ignore_eos": True,
    }
    buffered = server.post("/v1/completions", body).json()["choices"][0]
    events = sse_events(server.post("/v1/completions", {**body, "stream": True}))
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == buffered["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == buffered["logprobs"]["tokens"] and offsets == buffered["logprobs"]["text_offset"]
