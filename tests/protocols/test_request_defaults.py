"""Protocol defaults real clients rely on: the anthropic-version dates SDKs send, and omitted
output limits left to the server's default (never a codec constant)."""

from __future__ import annotations

import pytest
from anthropic._constants import ANTHROPIC_API_VERSION

from helios.frontend.inference import RequestError
from helios.protocols import openai_completions
from helios.protocols.anthropic_messages import count_tokens_decode, decode

BODY = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("version", ["2023-06-01", "2024-02-29", ANTHROPIC_API_VERSION, "2099-12-31"])
def test_2023_06_01_and_later_dated_versions_are_accepted(version: str) -> None:
    # The anthropic SDK sends its own release's date (2.14: 2026-10-21) unless told otherwise.
    request, _ = decode(BODY, headers_version=version)
    assert request.max_tokens == 8
    count_tokens_decode(BODY, version)


@pytest.mark.parametrize(
    "version",
    [
        None,
        "",
        "2023-05-31",
        "2022-12-31",
        "2023-02-30",
        "2026-1-01",
        "2026-10-21x",
        " 2026-10-21",
        "20261021",
        "latest",
        "2026-13-01",
    ],
)
def test_missing_malformed_unreal_or_earlier_versions_are_refused(version: str | None) -> None:
    with pytest.raises(RequestError, match="anthropic-version") as error:
        decode(BODY, headers_version=version)
    assert error.value.param is None
    with pytest.raises(RequestError, match="anthropic-version"):
        count_tokens_decode(BODY, version)


def test_completions_leave_an_omitted_max_tokens_to_the_server_default() -> None:
    request, _ = openai_completions.decode({"model": "x", "prompt": "hi"})
    assert request.max_tokens is None
    explicit, _ = openai_completions.decode({"model": "x", "prompt": "hi", "max_tokens": 0})
    assert explicit.max_tokens == 0
