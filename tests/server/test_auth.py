"""Serving-key checks: bearer on every route, x-api-key on Anthropic routes, both must match."""

from __future__ import annotations

import pytest

from helios.server.auth import bearer_token, check_key


@pytest.mark.parametrize("expected", [None, ""])
def test_no_key_disables_auth(expected: str | None) -> None:
    assert check_key(expected, None, None, allow_x_api_key=False) is None
    assert check_key(expected, "Bearer wrong", "wrong", allow_x_api_key=True) is None


@pytest.mark.parametrize("authorization", ["Bearer sk-1", "bearer sk-1", "BEARER   sk-1 ", " Bearer sk-1"])
def test_bearer_scheme_is_case_insensitive(authorization: str) -> None:
    assert check_key("sk-1", authorization, None, allow_x_api_key=False) is None


@pytest.mark.parametrize(
    "authorization,x_api_key,allow,ok",
    [
        (None, None, False, False),
        ("", None, False, False),
        ("Bearer sk-2", None, False, False),
        ("Basic sk-1", None, False, False),
        ("Bearer", None, False, False),
        ("sk-1", None, False, False),
        (None, "sk-1", False, False),  # OpenAI routes ignore x-api-key
        ("Bearer sk-1", "wrong", False, True),
        (None, "sk-1", True, True),
        (None, "sk-2", True, False),
        ("Bearer sk-1", "sk-1", True, True),
        ("Bearer sk-1", "sk-2", True, False),  # both supplied: both must match
        ("Bearer sk-2", "sk-1", True, False),
        ("Basic abc", "sk-1", True, False),
        ("Bearer sk-1x", None, True, False),
        ("Bearer sk-", None, True, False),
    ],
)
def test_check_key(authorization: str | None, x_api_key: str | None, allow: bool, ok: bool) -> None:
    message = check_key("sk-1", authorization, x_api_key, allow_x_api_key=allow)
    assert (message is None) == ok
    if not ok:
        assert "API key" in message  # type: ignore[operator]


def test_missing_and_invalid_messages_differ() -> None:
    missing = check_key("k", None, None, allow_x_api_key=True)
    invalid = check_key("k", "Bearer nope", None, allow_x_api_key=True)
    assert missing and invalid and missing != invalid and "x-api-key" in missing


def test_non_ascii_key_compares_safely() -> None:
    assert check_key("clé", "Bearer clé", None, allow_x_api_key=False) is None
    assert check_key("clé", "Bearer cle", None, allow_x_api_key=False) is not None
    assert bearer_token("Token x") is None
