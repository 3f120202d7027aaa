"""The neutral request model every protocol decodes into (and nothing protocol-shaped).

A request is either a conversation (messages of text, image, reasoning, tool-call and
tool-result parts, lowered through the chat template) or a raw prompt (text or token
ids), plus sampling, stop, output-limit and logprob options.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union


# ---------------------------------------------------------------------------- conversation
@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    data: bytes  # decoded image bytes (PNG, JPEG or static WebP)
    media_type: str


@dataclass(frozen=True, slots=True)
class ReasoningPart:
    text: str  # readable reasoning of an earlier assistant turn


@dataclass(frozen=True, slots=True)
class ToolCallPart:
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ToolResultPart:
    call_id: str
    content: tuple[TextPart | ImagePart, ...]
    is_error: bool = False


Part = Union[TextPart, ImagePart, ReasoningPart, ToolCallPart, ToolResultPart]


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "developer" | "user" | "assistant" | "tool"
    parts: tuple[Part, ...]
    name: str | None = None

    def text(self) -> str:
        """Text parts joined with blank lines (spec: text blocks are joined that way)."""
        return "\n\n".join(p.text for p in self.parts if isinstance(p, TextPart))

    def reasoning(self) -> str | None:
        """Reasoning parts joined the same way; None without any (an empty part still counts:
        templates and encoders render an empty reasoning block for it)."""
        texts = [p.text for p in self.parts if isinstance(p, ReasoningPart)]
        return "\n\n".join(texts) if texts else None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str  # as presented to the model (namespaced tools: "namespace__name")
    description: str | None
    parameters: Mapping[str, object]  # JSON schema of the arguments object
    kind: str = "function"  # "function" | "custom" (Responses text tools, presented as {"input": string})
    grammar: object | None = None  # custom tools: compiled grammar validating the completed input


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str = "auto"  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the selected tool when mode == "named"
    parallel: bool = True  # False: at most one call per response


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    thinking: bool | None = None  # None: the template's default; False disables reasoning where supported
    effort: str | None = None  # neutral effort level ("low", "medium", "high", "xhigh", "max")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, object] = field(default_factory=dict)  # chat_template_kwargs
    # Candidate prefix-checkpoint boundaries a client marked (Anthropic cache_control): the end of
    # part `part` of messages[message], as (message, part) pairs; at most four, request order.
    cache_marks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RawPrompt:
    """Exactly one of text / token_ids is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class StopOptions:
    strings: tuple[str, ...] = ()  # <= 4 nonempty strings, <= 4096 UTF-8 bytes in total
    token_ids: tuple[int, ...] = ()
    token_sequences: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    top: int | None = None  # None: no generation logprobs; else alternatives per token
    token_ids: tuple[int, ...] = ()  # explicit ids replacing natural alternatives (deduplicated)
    prompt: int | None = None  # prompt logprobs: None or alternatives per position
    as_token_ids: bool = False  # return_tokens_as_token_ids: "token_id:<id>" strings


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A constraint on the final answer; reasoning and tool-call envelopes stay free."""

    kind: str  # "json_schema" | "json_object" | "lark" | "regex"
    definition: str  # json_schema: the schema as JSON text; json_object: ""; lark/regex: the grammar text
    param: str  # the request field that carried it, named in errors (e.g. "response_format")


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The request's sampling fields, their types checked by the protocol decoder (fields.sampling).

    None (or () for logit_bias) means omitted: the core's prepared default. Ranges are the
    frontend's to check and clamp into the core's declared ones (frontend/sampling.py).
    """

    temperature: float | None = None  # finite
    top_p: float | None = None  # finite
    top_k: int | None = None  # an integer; -1 and 0 mean disabled, below -1 is refused by the frontend
    min_p: float | None = None  # finite
    repetition_penalty: float | None = None  # finite
    presence_penalty: float | None = None  # finite
    frequency_penalty: float | None = None  # finite
    seed: int | None = None  # any integer; advanced by the choice index, then taken modulo 2**63
    # (token id, bias) pairs in request order; biases finite numbers as sent (int or float), ids
    # integers: the vocabulary, [-100, 100] and the entry count are the frontend's to check.
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    # The (first) input; a raw completions batch also lists every prompt in `batch`.
    input: Conversation | RawPrompt
    sampling: SamplingOptions
    max_tokens: int | None  # None: the server default bounded by the remaining context; 0: no output
    n: int = 1
    stop: StopOptions = StopOptions()
    logprobs: LogprobOptions = LogprobOptions()
    echo: bool = False  # raw completions: prepend the prompt to the output
    stream: bool = False
    thinking_token_budget: int | None = None  # conversational requests only
    output: OutputConstraint | None = None  # structured output (conversational requests only)
    cache_salt: str | None = None  # prefix-cache partition: only requests with the same salt share cached prefixes
    # Messages' thinking.budget_tokens without an explicit thinking_token_budget: a hard cap only
    # where the model's reasoning syntax allows one, otherwise just the effort hint it also set.
    budget_is_hint: bool = False
    # Messages' budgets above the 32-bit output limit: explicit, and never cut (no server default).
    uncapped_reasoning: bool = False
    batch: tuple[RawPrompt, ...] = ()  # raw completions with several prompts: all of them, in order

    @property
    def inputs(self) -> tuple[Conversation | RawPrompt, ...]:
        """Every input the request generates for, in prompt order (choice i * n + j is input i's j-th)."""
        return self.batch or (self.input,)


class Termination(enum.Enum):
    """Why a choice ended; each protocol maps it to its own finish reason."""

    EOS = "eos"
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"
    ERROR = "error"


class RequestError(ValueError):
    """Invalid request (HTTP 400 in every protocol); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
