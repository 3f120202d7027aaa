"""OpenAI (legacy) Completions: raw prompts, batched prompts, echo, and array-style logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helios.frontend.generate import Usage
from helios.frontend.inference import InferenceRequest, LogprobOptions, RawPrompt, RequestError, StopOptions, Termination
from helios.frontend.output import OutputDelta, TokenEntry
from helios.protocols import fields as f
from helios.protocols.openai_common import finish_reason, now, usage_object

UNSUPPORTED = ("suffix", "tools", "tool_choice", "thinking_token_budget", "response_format")


@dataclass(frozen=True, slots=True)
class CompletionOptions:
    model: str
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # Completions' integer logprobs (alternatives in the arrays)
    echo: bool
    num_prompts: int


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
    raise RequestError("prompt must be a string, an array of strings, a token-id array, or an array of token-id arrays",
                       "prompt")  # fmt: skip


def decode(body: dict[str, Any]) -> tuple[InferenceRequest, list[RawPrompt], CompletionOptions]:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, "", []):
            raise RequestError(f"{name} is not supported on /v1/completions", name)
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("model is required (any string: the loaded model answers)", "model")
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
    token_ids = f.int_list(body["logprob_token_ids"], "logprob_token_ids") if body.get("logprob_token_ids") else ()
    if token_ids and logprobs is None:
        raise RequestError("logprob_token_ids requires logprobs", "logprob_token_ids")
    stream_options = f.optional_object(body, "stream_options") or {}
    include_usage = bool(stream_options.get("include_usage")) if stream else False
    request = InferenceRequest(
        input=prompts[0],
        sampling=f.sampling(body),
        max_tokens=max_tokens,
        n=n,
        stop=StopOptions(
            strings=f.stop_strings(body),
            token_ids=f.int_list(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") else (),
            token_sequences=f.token_sequences(body, "stop_token_sequences"),
            ignore_eos=f.optional_bool(body, "ignore_eos"),
        ),
        logprobs=LogprobOptions(top=logprobs, token_ids=token_ids, prompt=prompt_logprobs,
                                as_token_ids=f.optional_bool(body, "return_tokens_as_token_ids")),  # fmt: skip
        echo=echo,
        stream=stream,
    )
    options = CompletionOptions(model, include_usage, include_usage and bool(stream_options.get("continuous_usage_stats")),
                                logprobs, echo, len(prompts))  # fmt: skip
    return request, prompts, options


# ---------------------------------------------------------------------------- encoding
@dataclass
class Arrays:
    """Completions' parallel logprob arrays for one choice."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    chars: int = 0  # characters of text released so far (offsets of later tokens start here)

    def add_generated(self, entries: tuple[TokenEntry, ...], text: str, offsets: list[int]) -> None:
        for entry, offset in zip(entries, offsets):
            self.tokens.append(entry.token)
            self.token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for alt in entry.top:
                top.setdefault(alt.token, alt.logprob)
            self.top_logprobs.append(top)
            self.text_offset.append(offset)
        self.chars += len(text)

    def since(self, start: int) -> "Arrays":
        """The entries from `start` on (one stream frame's share)."""
        return Arrays(self.tokens[start:], self.token_logprobs[start:], self.top_logprobs[start:],
                      self.text_offset[start:], self.chars)  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}  # fmt: skip


def add_prompt_entries(arrays: Arrays, prompt_ids: tuple[int, ...], entries: tuple | None, token_text, limit: int) -> None:
    """Echoed prompt positions: null first entry, then each prompt token's logprob and alternatives."""
    for position, token_id in enumerate(prompt_ids):
        text = token_text(token_id)
        arrays.tokens.append(text)
        arrays.text_offset.append(arrays.chars)
        arrays.chars += len(text)
        entry = entries[position] if entries is not None and position < len(entries) else None
        if entry is None:
            arrays.token_logprobs.append(None)
            arrays.top_logprobs.append(None)
            continue
        arrays.token_logprobs.append(entry[token_id].logprob)
        alternatives = sorted(entry.items(), key=lambda item: (-item[1].logprob, item[0]))
        top: dict[str, float] = {}
        for alt_id, value in alternatives[: max(limit, 0)] + [(token_id, entry[token_id])]:
            top.setdefault(token_text(alt_id), value.logprob)
        arrays.top_logprobs.append(top)


def choice_json(index: int, text: str, arrays: Arrays | None, finish: Termination | None,
                prompt_logprobs: list | None = None) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {"index": index, "text": text, "logprobs": arrays.as_json() if arrays else None,
                            "finish_reason": finish_reason(finish)}  # fmt: skip
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def response(request_id: str, model: str, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage_object(usage, reasoning=False)}  # fmt: skip


def chunk(request_id: str, model: str, created: int, choice: dict[str, Any], usage: dict | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [choice]}  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    return body


def usage_chunk(request_id: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage_object(usage, reasoning=False)}  # fmt: skip


__all__ = ["Arrays", "CompletionOptions", "OutputDelta", "add_prompt_entries", "choice_json", "chunk", "decode",
           "response", "usage_chunk"]  # fmt: skip
