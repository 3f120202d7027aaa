"""Conversation lowering (frontend/prompt.py): system/developer merging, the inline-system
fallback; and the facade's limits and option checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios.config import ServerConfig
from helios.core import Core
from helios.core.template import ChatTemplate
from helios.frontend import prompt
from helios.frontend.inference import (
    Conversation,
    LogprobOptions,
    Message,
    RawPrompt,
    RequestError,
    StopOptions,
    TextPart,
)
from helios.frontend.request import Frontend
from tests.frontend.raw_requests import request_for

NO_INLINE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role only at the start') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _msg(role: str, text: str) -> Message:
    return Message(role, (TextPart(text),))


@pytest.fixture(scope="module")
def frontend(tiny_core: Path) -> Frontend:
    return Frontend(Core.open(tiny_core), ServerConfig())


def test_developer_and_system_merge_into_one_leading_message(frontend: Frontend) -> None:
    messages = (_msg("system", "S1"), _msg("user", "U"), _msg("developer", "D1"), _msg("assistant", "A"))
    arranged = prompt.arrange(frontend, messages)
    assert [m.role for m in arranged] == ["system", "user", "assistant"]
    assert arranged[0].text() == "system:\nS1\n\ndeveloper:\nD1"


def test_noninitial_system_becomes_wrapped_user_text_when_the_template_cannot_inline(frontend: Frontend) -> None:
    strict = Frontend.__new__(Frontend)
    strict.__dict__.update(frontend.__dict__)
    strict.template = ChatTemplate(NO_INLINE, {})
    messages = (_msg("system", "lead"), _msg("user", "U"), _msg("system", "late"), _msg("system", ""))
    arranged = prompt.arrange(strict, messages)
    assert [(m.role, m.text()) for m in arranged] == [
        ("system", "lead"),
        ("user", "U"),
        ("user", "<system>late</system>"),
    ]
    text = strict.render(Conversation(messages))
    assert text == "<system>lead</system><user>U</user><user><system>late</system></user><assistant>"
    # The SmolLM2 template renders inline system messages, so they stay as they are.
    assert [m.role for m in prompt.arrange(frontend, messages)] == ["system", "user", "system"]


def test_text_parts_join_with_blank_lines(frontend: Frontend) -> None:
    message = Message("user", (TextPart("a"), TextPart("b")))
    assert prompt.template_message(frontend, message)["content"] == "a\n\nb"


def test_context_and_option_limits(frontend: Frontend) -> None:
    hello = frontend.prompt(RawPrompt(text="hello"))
    request = request_for("hello", 10**6)  # bounded, not refused
    assert frontend.max_tokens(request, len(hello.token_ids)) == frontend.max_model_len - len(hello.token_ids)
    unbounded = request_for("hello", None)
    assert frontend.max_tokens(unbounded, len(hello.token_ids)) == frontend.max_model_len - len(hello.token_ids)
    with pytest.raises(RequestError, match="at most 20"):
        frontend.check_options(request_for("x", logprobs=LogprobOptions(top=21)))
    with pytest.raises(RequestError, match="combine"):
        frontend.check_options(request_for("x", stop=StopOptions(strings=("a",), token_ids=(3,))))
    with pytest.raises(RequestError, match="4096"):
        frontend.check_options(request_for("x", stop=StopOptions(strings=("é" * 2100,))))


def test_empty_raw_prompt_uses_bos(frontend: Frontend) -> None:
    assert frontend.prompt(RawPrompt(text="")).token_ids == (frontend.manifest.tokenizer.bos_token_id,)
    with pytest.raises(RequestError):
        frontend.prompt(RawPrompt(token_ids=()))
