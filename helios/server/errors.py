"""The error dialects, as the server imports them (the bodies are protocol encoding:
helios/protocols/errors.py)."""

from helios.protocols.errors import anthropic_error, anthropic_type, openai_error, openai_type

__all__ = ["anthropic_error", "anthropic_type", "openai_error", "openai_type"]
