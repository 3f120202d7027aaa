"""The output limit a request gets: the server default when omitted, bounded by the context the
prompt leaves (spec: the default-budget row); only a prompt that leaves no room is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend.inference import Conversation, InferenceRequest, Message, RawPrompt, RequestError, TextPart
from helios.frontend.request import Frontend


@pytest.fixture(scope="module")
def core(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def _raw(max_tokens: int | None) -> InferenceRequest:
    return InferenceRequest(RawPrompt(text="hello"), {}, max_tokens=max_tokens)


def test_the_default_is_an_integer_the_whole_context_unless_configured(core: Core) -> None:
    unset = Frontend(core, ServerConfig())
    assert unset.default_max_tokens == unset.max_model_len == core.manifest.limits.max_model_len
    assert Frontend(core, ServerConfig(default_max_tokens=100)).default_max_tokens == 100
    assert Frontend(core, ServerConfig(default_max_tokens=10**6)).default_max_tokens == unset.max_model_len


def test_an_omitted_limit_uses_the_configured_default_bounded_by_the_remaining_context(core: Core) -> None:
    frontend = Frontend(core, ServerConfig(default_max_tokens=100))
    assert frontend.max_tokens(_raw(None), 10) == 100
    assert frontend.max_tokens(_raw(None), frontend.max_model_len - 42) == 42
    assert frontend.max_tokens(_raw(7), 10) == 7


def test_an_over_long_limit_is_bounded_by_the_remaining_context_instead_of_refused(core: Core) -> None:
    # Claude Code sends max_tokens 32000 with a 3.9k-token prompt; OpenCode 32000 with 2.2k.
    frontend = Frontend(core, ServerConfig())
    context = frontend.max_model_len
    assert frontend.max_tokens(_raw(32000), 3900) == context - 3900
    assert frontend.max_tokens(_raw(32000), context - 1) == 1
    assert frontend.max_tokens(_raw(10**6), 5) == context - 5


@pytest.mark.parametrize("beyond", [0, 800])
def test_a_prompt_that_leaves_no_room_for_one_token_is_refused(core: Core, beyond: int) -> None:
    frontend = Frontend(core, ServerConfig())
    prompt_len = frontend.max_model_len + beyond
    with pytest.raises(RequestError, match="leaves no room") as raw:
        frontend.max_tokens(_raw(1), prompt_len)
    assert raw.value.param == "prompt"
    chat = InferenceRequest(Conversation((Message("user", (TextPart("hi"),)),)), {}, max_tokens=None)
    with pytest.raises(RequestError, match="leaves no room") as conversation:
        frontend.max_tokens(chat, prompt_len)
    assert conversation.value.param == "messages"
