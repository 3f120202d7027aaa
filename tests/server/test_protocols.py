"""The SDK protocol tests against a live service: any helios (or another server that claims the
contract), named by FLARE_API_TEST_URL, with FLARE_API_TEST_KEY where it requires a key.

    pip install -e '.[api-test]'
    FLARE_API_TEST_URL=http://127.0.0.1:8000 python -m pytest tests/server/test_protocols.py -q

Skipped without FLARE_API_TEST_URL. The official SDKs parse every body and event with strict
response validation, at the versions the api-test extra pins. The checks hold for any core:
they read the served model from /v1/models and ask only for short answers.
"""

from __future__ import annotations

import os

import pytest

URL = os.environ.get("FLARE_API_TEST_URL", "").rstrip("/")
KEY = os.environ.get("FLARE_API_TEST_KEY") or "unused"  # SDKs need a nonempty key; open servers ignore it

pytestmark = pytest.mark.skipif(not URL, reason="set FLARE_API_TEST_URL to a running service to run these")

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def oai():
    return openai.OpenAI(base_url=f"{URL}/v1", api_key=KEY, _strict_response_validation=True, max_retries=0)


@pytest.fixture(scope="module")
def claude():
    return anthropic.Anthropic(base_url=URL, api_key=KEY, _strict_response_validation=True, max_retries=0)


@pytest.fixture(scope="module")
def model(oai) -> str:
    models = oai.models.list().data
    assert models, "the service lists no model"
    return models[0].id


def test_health_needs_no_key() -> None:
    response = httpx.get(f"{URL}/health", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_models_list_and_retrieve(oai, model: str) -> None:
    assert oai.models.retrieve(model).id == model


def test_chat_buffered(oai, model: str) -> None:
    raw = oai.chat.completions.with_raw_response.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert raw.headers.get("x-request-id")
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 8


def test_chat_streamed_matches_its_usage(oai, model: str) -> None:
    stream = oai.chat.completions.create(
        model=model, messages=ASK, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 8


def test_completions(oai, model: str) -> None:
    completion = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.usage.completion_tokens <= 4


def test_responses(oai, model: str) -> None:
    response = oai.responses.create(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens <= 16


def test_messages_buffered_and_streamed(claude, model: str) -> None:
    message = claude.messages.create(model=model, max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=model, max_tokens=8, messages=ASK, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens <= 8


def test_bad_input_is_a_400_in_each_protocol_shape(oai, claude, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature="hot")  # type: ignore[arg-type]
    assert chat.value.status_code == 400 and "temperature" in str(chat.value)
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model=model, max_tokens=4, messages=ASK, extra_body={"temperature": "hot"})
    assert messages.value.status_code == 400 and "temperature" in str(messages.value)
