"""A request's whole preparation, in one call on the frontend pool: option checks, the output
grammar, prompt lowering, output limits and sampling parameters, into the engine requests the
server submits after admission (one per prompt; its n choices share the prefill).

Every RequestError a request can earn before admission comes from here or its protocol decoder.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

from helios.engine import EngineRequest, ReasoningBudget
from helios.frontend.checks import check_options
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint
from helios.frontend.grammar import GrammarError
from helios.frontend.inference import (
    Conversation,
    InferenceRequest,
    Message,
    OutputConstraint,
    RawPrompt,
    RequestError,
    TextPart,
)
from helios.frontend.parsers.budget import output_starts_in_reasoning, tool_exits
from helios.frontend.parsers.reasoning import close_token, starts_in_reasoning, token_delimiters
from helios.frontend.parsers.tools import tool_opener_ids
from helios.frontend.prompt import PreparedPrompt
from helios.frontend.sampling import resolve_sampling

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from helios.frontend.request import Frontend


@dataclass(frozen=True, slots=True)
class PreparedInput:
    """One prompt of a prepared request."""

    prompt: PreparedPrompt
    # What the engine runs for it; None when nothing runs (max_tokens 0 without prompt scoring):
    # its choices end with zero tokens. A scored zero-token prompt runs one choice for all n.
    engine: EngineRequest | None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to admit and submit; building it refused everything the frontend can."""

    request: InferenceRequest  # as prepared: a budget the model cannot cap that was only a hint is dropped
    request_id: str  # the x-request-id; input i runs as engine request f"{request_id}.{i}"
    inputs: tuple[PreparedInput, ...]  # prompt order; global choice index = input index * n + choice index

    @property
    def num_choices(self) -> int:
        """Admission slots the request takes: one per choice of every prompt."""
        return len(self.inputs) * self.request.n


def prepare(
    fe: Frontend, request: InferenceRequest, request_id: str, prompts: Sequence[PreparedPrompt] | None = None
) -> Prepared:
    """Check, compile, lower, bound and parameterize `request` (CPU work: run it on the pool).

    `prompts` are the inputs already lowered, one per input (label scoring renders its own).
    """
    request = _applied_budget(fe, request)
    check_options(request, fe.manifest)
    matcher = compile_output(fe, request.output) if request.output is not None else None
    if prompts is None:
        prompts = [fe.prompt(source, request.output) for source in request.inputs]
    limits = [fe.limits.output_limit(request, len(prompt.token_ids)) for prompt in prompts]
    inputs = tuple(
        PreparedInput(prompt, _engine_request(fe, request, f"{request_id}.{i}", prompt, limit, i * request.n, matcher))
        for i, (prompt, limit) in enumerate(zip(prompts, limits))
    )
    return Prepared(request, request_id, inputs)


def compile_output(fe: Frontend, output: OutputConstraint) -> LLMatcher:
    """The constraint's pristine grammar matcher, compiled through the shared cache (bounded in time)."""
    try:
        return fe.grammars.compile(output.kind, output.definition, output.param)
    except GrammarError as exc:
        raise RequestError(exc.message, exc.field) from None


def _applied_budget(fe: Frontend, request: InferenceRequest) -> InferenceRequest:
    """Messages' thinking.budget_tokens is only an effort hint where the reasoning syntax allows
    no hard cap (no single-token close delimiter): then no budget reaches the checks."""
    if request.thinking_token_budget is None or not request.budget_is_hint:
        return request
    syntax = fe.manifest.recipe.reasoning_syntax
    if syntax and close_token(syntax, fe.tokenizer) is not None:
        return request
    return dataclasses.replace(request, thinking_token_budget=None)


def _engine_request(
    fe: Frontend,
    request: InferenceRequest,
    request_id: str,
    prompt: PreparedPrompt,
    max_tokens: int,
    first_choice: int,
    matcher: LLMatcher | None,
) -> EngineRequest | None:
    """The engine request of one prompt; seeds start at its first global choice index, so batched
    prompts do not repeat each other's samples."""
    lp = request.logprobs
    if max_tokens == 0 and lp.prompt is None:
        return None
    n = 1 if max_tokens == 0 else request.n  # only scored: its n choices share one score
    spec = fe.manifest.recipe.sampling
    params = tuple(
        resolve_sampling(spec, request.sampling, choice_index=first_choice + j, vocab_size=fe.vocab_size)
        for j in range(n)
    )
    budget = request.thinking_token_budget
    if budget is None and isinstance(request.input, Conversation) and not request.uncapped_reasoning:
        budget = fe.config.thinking_token_budget  # the operator default for conversational requests
    return EngineRequest(
        request_id=request_id,
        prompt_ids=prompt.token_ids,
        params=params,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(request.stop.token_ids),
        stop_token_sequences=tuple(request.stop.token_sequences),
        ignore_eos=request.stop.ignore_eos,
        num_top_logprobs=lp.top,
        logprob_token_ids=tuple(dict.fromkeys(lp.token_ids)),
        prompt_logprobs=lp.prompt,
        use_prefix_cache=fe.config.prefix_cache,
        cache_identity=salt_identity(request.cache_salt),
        reasoning_budget=reasoning_budget(fe, budget, prompt.token_ids, request.input) if budget is not None else None,
        constraint=_constraint(fe, request, prompt.token_ids, matcher) if matcher is not None else None,
        checkpoint_hints=prompt.checkpoint_hints,
        images=prompt.images,
    )


def _constraint(
    fe: Frontend, request: InferenceRequest, prompt_ids: tuple[int, ...], matcher: LLMatcher
) -> GrammarConstraint:
    """The request's pristine constraint: free reasoning first where the prompt or model opens it."""
    recipe = fe.manifest.recipe
    delimiters = token_delimiters(recipe.reasoning_syntax, fe.tokenizer) if recipe.reasoning_syntax else None
    open_id, close_id = delimiters or (None, None)
    tools_on = _tools_on(request.input)
    openers = tool_opener_ids(recipe.tool_syntax, fe.tokenizer) if tools_on and recipe.tool_syntax else frozenset()
    inside = delimiters is not None and starts_in_reasoning(prompt_ids, delimiters[0], delimiters[1])
    return GrammarConstraint(matcher, ConstraintPlan(open_id, close_id, openers, inside))


def _tools_on(source: Conversation | RawPrompt) -> TypeGuard[Conversation]:
    """Whether the output parser reads tool calls in this input's output (as generate.py builds it)."""
    return isinstance(source, Conversation) and bool(source.tools) and source.tool_choice.mode != "none"


def reasoning_budget(
    fe: Frontend, budget: int, prompt_ids: tuple[int, ...], source: Conversation | RawPrompt
) -> ReasoningBudget | None:
    """The engine's hard cap, when output starts inside reasoning; None when it starts in content
    (accepted without a cut). A start inside reasoning needs a single-token close to force."""
    syntax = fe.manifest.recipe.reasoning_syntax
    if syntax is None or not output_starts_in_reasoning(fe.tokenizer, syntax, prompt_ids):
        return None
    close_id = close_token(syntax, fe.tokenizer)
    if close_id is None:
        raise RequestError(
            f"thinking_token_budget needs a single-token reasoning close where output starts in reasoning; "
            f"this model's reasoning syntax ({syntax}) closes with several tokens",
            "thinking_token_budget",
        )
    delimiters = token_delimiters(syntax, fe.tokenizer)
    implicit, gate = frozenset[int](), None
    tool_syntax = fe.manifest.recipe.tool_syntax
    if tool_syntax and _tools_on(source):
        implicit, gate = tool_exits(fe.tokenizer, tool_syntax, source.tools)
    return ReasoningBudget(budget, delimiters[0] if delimiters else None, close_id, implicit, gate)


_DEFAULT_CHAT = Conversation((Message("user", (TextPart("Hello"),)),))


def default_budget_problem(fe: Frontend) -> str | None:
    """Why [server] thinking_token_budget cannot cap this core's default requests, or None. It needs
    reasoning syntax, a single-token close, and a default output start it cuts: the generation
    prompt of a plain chat (recipe and template defaults) must leave reasoning open."""
    syntax = fe.manifest.recipe.reasoning_syntax
    if syntax is None:
        return "it declares no reasoning syntax"
    if close_token(syntax, fe.tokenizer) is None:
        return f"its reasoning syntax {syntax!r} does not close with a single-token delimiter"
    try:
        prompt = fe.prompt(_DEFAULT_CHAT)
    except RequestError as exc:
        return f"its default chat prompt does not render ({exc.message})"
    if not output_starts_in_reasoning(fe.tokenizer, syntax, prompt.token_ids):
        return "its default generation prompt starts output in content, where a budget never cuts"
    return None


def salt_identity(salt: str | None) -> bytes:
    """The prefix-cache identity of a cache salt: requests share cached pages only with the same one."""
    if salt is None:
        return b""
    return b"salt:" + hashlib.blake2b(salt.encode("utf-8"), digest_size=16).digest()
