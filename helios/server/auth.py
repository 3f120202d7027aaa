"""Serving-key check for generation and model routes (/health and /metrics skip it).

OpenAI routes read `Authorization: Bearer KEY`; Anthropic routes also accept `x-api-key`,
and when a request carries both headers each must hold the key.
"""

from __future__ import annotations

import hmac


def _same(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())


def bearer_token(authorization: str | None) -> str | None:
    """The token of a `Bearer` credential (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_key(
    expected: str | None, authorization: str | None, x_api_key: str | None, allow_x_api_key: bool
) -> str | None:
    """None when the request may proceed, else the 401 message. An empty key disables auth."""
    if not expected:
        return None
    supplied: list[str | None] = []
    if authorization and authorization.strip():
        supplied.append(bearer_token(authorization))
    if allow_x_api_key and x_api_key and x_api_key.strip():
        supplied.append(x_api_key.strip())
    if not supplied:
        header = "Authorization: Bearer or x-api-key" if allow_x_api_key else "Authorization: Bearer"
        return f"Missing API key: send it as {header}"
    # Compare every supplied credential (no short-circuit) so timing reveals nothing.
    matches = [token is not None and _same(expected, token) for token in supplied]
    if not all(matches):
        return "Invalid API key"
    return None
