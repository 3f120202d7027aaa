"""OpenAI (legacy) Completions: raw prompts, batched prompts, echo, and array-style logprobs.

This module decodes requests; openai_completions_encoding.py renders choices and chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from helios.frontend.inference import InferenceRequest, RawPrompt, RequestError
from helios.protocols import fields as f
from helios.protocols.openai_common import OpenAIOptions

UNSUPPORTED = ("suffix", "tools", "tool_choice", "thinking_token_budget", "response_format")


@dataclass(frozen=True, slots=True)
class CompletionOptions(OpenAIOptions):
    logprobs: int | None  # Completions' integer logprobs (alternatives in the arrays)
    echo: bool
    num_prompts: int
    prompt_logprobs: int | None = None  # alternatives in the prompt_logprobs field


def _prompts(value: Any) -> list[RawPrompt]:
    if isinstance(value, str):
        return [RawPrompt(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [RawPrompt(text=v) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [RawPrompt(token_ids=tuple(value))]
        if all(isinstance(v, list) for v in value):
            prompts = [RawPrompt(token_ids=f.int_list(v, "prompt")) for v in value]
            if any(not p.token_ids for p in prompts):
                raise RequestError("token-id prompts must not be empty", "prompt")
            return prompts
    if isinstance(value, list) and not value:
        raise RequestError("prompt must not be an empty array", "prompt")
    raise RequestError(
        "prompt must be a string, an array of strings, a token-id array, or an array of token-id arrays", "prompt"
    )


def decode(body: dict[str, Any]) -> tuple[InferenceRequest, CompletionOptions]:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, "", []):
            raise RequestError(f"{name} is not supported on /v1/completions", name)
    model = f.model(body)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompts = _prompts(body["prompt"])
    n = f.optional_int(body, "n", 1, 128) or 1
    best_of = f.optional_int(body, "best_of", 1, 128)
    if best_of is not None and best_of != n:
        raise RequestError("best_of must equal n (ranked sampling is not supported)", "best_of")
    max_tokens = f.optional_int(body, "max_tokens", 0)  # None: the server's default_max_tokens
    logprobs = f.optional_int(body, "logprobs", 0, 20)
    echo = f.optional_bool(body, "echo")
    stream = f.optional_bool(body, "stream")
    prompt_logprobs = f.optional_int(body, "prompt_logprobs", 0, 20)
    if stream and body.get("prompt_logprobs") is not None:
        raise RequestError("prompt_logprobs cannot be streamed", "prompt_logprobs")
    if prompt_logprobs is None and echo and logprobs is not None:
        prompt_logprobs = logprobs  # echo with logprobs scores the prompt
    # The engine scores the prompt for both: logprobs sets the echoed arrays' alternatives and
    # prompt_logprobs the field's (each cut to its own count when they differ).
    scored = max(prompt_logprobs, logprobs) if prompt_logprobs is not None and echo and logprobs is not None else None
    generation_logprobs = f.logprob_options(body, logprobs, "logprobs")
    include_usage, continuous = f.stream_usage(body, stream)
    request = InferenceRequest(
        input=prompts[0],
        sampling=f.sampling(body),
        max_tokens=max_tokens,
        n=n,
        stop=f.stop_options(body),
        logprobs=replace(generation_logprobs, prompt=scored if scored is not None else prompt_logprobs),
        echo=echo,
        stream=stream,
        cache_salt=f.cache_salt(body),
        batch=tuple(prompts) if len(prompts) > 1 else (),
    )
    options = CompletionOptions(
        model,
        include_usage,
        continuous,
        logprobs,
        echo,
        len(prompts),
        prompt_logprobs,
    )
    return request, options
