"""Neutral requests as the frontend tests build them: a prompt, default sampling, a few options."""

from __future__ import annotations

from typing import Any

from helios.frontend.inference import Conversation, InferenceRequest, RawPrompt, SamplingOptions


def request_for(
    prompt: str | tuple[int, ...] | Conversation, max_tokens: int | None = 1, **options: Any
) -> InferenceRequest:
    """A request for `prompt` (raw text, raw token ids, or a conversation) with default sampling;
    `options`: any other InferenceRequest fields (n, logprobs, stop, ...)."""
    if isinstance(prompt, str):
        prompt = RawPrompt(text=prompt)
    elif isinstance(prompt, tuple):
        prompt = RawPrompt(token_ids=prompt)
    return InferenceRequest(prompt, SamplingOptions(), max_tokens, **options)
