"""Error bodies match the OpenAI and Anthropic wire shapes with the types api.md assigns by status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helios.server.errors import anthropic_error, openai_error

SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "external"


# The error type api.md assigns to each status, on the OpenAI and on the Anthropic wire.
TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    413: ("request_too_large", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "api_error"),
}


@pytest.mark.parametrize("status", TYPES)
def test_openai_error_shape(status: int) -> None:
    type_ = TYPES[status][0]
    assert openai_error(status, "boom") == {"error": {"type": type_, "message": "boom", "param": None, "code": None}}


def test_openai_model_not_found_and_overrides() -> None:
    body = openai_error(404, "The model 'x' does not exist", code="model_not_found")
    assert body["error"] == {
        "type": "not_found_error",
        "message": "The model 'x' does not exist",
        "param": None,
        "code": "model_not_found",
    }
    assert openai_error(400, "m", type="custom")["error"]["type"] == "custom"


@pytest.mark.parametrize("status", TYPES)
def test_anthropic_error_shape(status: int) -> None:
    type_ = TYPES[status][1]
    assert anthropic_error(status, "boom") == {"type": "error", "error": {"type": type_, "message": "boom"}}
    assert anthropic_error(status, "m", type="overloaded_error")["error"]["type"] == "overloaded_error"


def test_openai_error_has_the_schema_required_fields() -> None:
    path = SPEC / "openai-openapi.nullable-fixed.json"
    if not path.exists():
        pytest.skip("OpenAI spec not present")
    schema = json.loads(path.read_text())["components"]["schemas"]["Error"]
    assert set(openai_error(500, "x")["error"]) == set(schema["required"])


def test_anthropic_types_are_named_in_the_hosted_spec() -> None:
    path = SPEC / "anthropic-hosted_spec.json"
    if not path.exists():
        pytest.skip("Anthropic spec not present")
    text = path.read_text()
    for status in (400, 401, 404, 429, 500):  # request_too_large is documented by Anthropic, not in this spec
        assert f'"{anthropic_error(status, "x")["error"]["type"]}"' in text
