"""Pieces shared by the OpenAI-shaped protocols: finish reasons, usage, chat-style logprobs, the chunk stream."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from helios.frontend.generate import Submission, Usage
from helios.frontend.inference import Termination
from helios.frontend.output import TokenEntry
from helios.protocols.encoding import KEEPALIVE_COMMENT, data_frame
from helios.protocols.errors import openai_error


@dataclass(frozen=True, slots=True)
class OpenAIOptions:
    """What an OpenAI-shaped route (Chat, Completions) keeps of a request beside the neutral one."""

    model: str
    include_usage: bool  # the stream ends with a usage chunk (stream_options: fields.stream_usage)
    continuous_usage: bool  # every chunk carries usage too


FINISH_REASONS = {
    Termination.EOS: "stop",
    Termination.STOP_STRING: "stop",
    Termination.STOP_TOKEN: "stop",
    Termination.ABORT: "stop",
    Termination.LENGTH: "length",
    Termination.TOOL_CALLS: "tool_calls",
}


def finish_reason(termination: Termination | None) -> str | None:
    return None if termination is None else FINISH_REASONS.get(termination, "stop")


def now() -> int:
    return int(time.time())


def chat_logprob_entry(entry: TokenEntry) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in entry.top],
    }


def usage_object(usage: Usage, *, reasoning: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.image_tokens:  # image requests (spec: usage)
        body["prompt_tokens_details"]["multimodal_tokens"] = {"image": usage.image_tokens}
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def prompt_logprobs_wire(
    entries: tuple | None, decode, as_token_ids: bool = False, limit: int | None = None
) -> list | None:
    """vLLM-style prompt logprobs: [null, {"id": {"logprob", "rank", "decoded_token"}}, ...].

    `limit`: the alternatives the caller asked for, where the engine scored more (Completions'
    echo arrays may want more than prompt_logprobs): the actual token, then the top `limit`."""
    if entries is None:
        return None
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        if limit is not None:
            actual = next(iter(entry))  # prompt entries put the actual token first
            top = sorted(entry.items(), key=lambda item: (-item[1].logprob, item[0]))[:limit]
            entry = {actual: entry[actual], **dict(top)}
        out.append(
            {
                str(token_id): {"logprob": value.logprob, "rank": value.rank, "decoded_token": decode(token_id)}
                for token_id, value in entry.items()
            }
        )
    return out


def stream_chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk object ("chat.completion.chunk" or "text_completion"), usage when given."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


DONE = b"data: [DONE]\n\n"


class ChunkStream:
    """The shared half of the OpenAI chunk streams (Chat, Completions): keepalive comments, the
    usage they report, the close (the usage chunk when asked for, then [DONE]) and errors."""

    kind: ClassVar[str]  # the chunks' "object": "chat.completion.chunk" or "text_completion"
    reasoning: ClassVar[bool]  # usage reports completion_tokens_details.reasoning_tokens

    def __init__(self, run: Submission, model: str, options: OpenAIOptions) -> None:
        self.run, self.model, self.options = run, model, options

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE_COMMENT]

    def usage(self) -> dict[str, Any]:
        """The run's usage so far, in this route's shape."""
        return usage_object(self.run.usage(), reasoning=self.reasoning)

    def finish(self) -> list[bytes]:
        if not self.options.include_usage:
            return [DONE]
        run = self.run
        return [data_frame(stream_chunk(self.kind, run.request_id, self.model, run.created, [], self.usage())), DONE]

    def error(self, status: int, message: str) -> list[bytes]:
        return [data_frame(openai_error(status, message))]  # no [DONE] after a failure
