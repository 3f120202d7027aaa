"""Running a prepared request on the engine and turning its events into neutral deltas.

One `Generation` per submitted prompt (its n choices share the prompt's prefill). The
server merges several generations (batched completions) into one ordered stream of
(choice index, delta) pairs; protocols only encode those deltas.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from helios.engine.client import EngineClient
from helios.engine.request import EngineEvent
from helios.frontend.choice import ChoiceStream
from helios.frontend.detokenizer import TokenBytes
from helios.frontend.events import SemanticEvent
from helios.frontend.inference import Conversation, InferenceRequest
from helios.frontend.output import ChoiceOutput, OutputDelta
from helios.frontend.parsers import build_parser
from helios.frontend.request import Frontend, PreparedPrompt

Item = tuple[int, OutputDelta, list[SemanticEvent]]  # (global choice index, raw delta, semantic events)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(eq=False)
class Generation:
    """The choices of one prompt, as they come out of the engine."""

    prompt: PreparedPrompt
    first_index: int  # global choice index of this prompt's first choice
    choices: list[ChoiceStream]
    events: AsyncIterator[EngineEvent] | None  # None: nothing submitted (max_tokens 0)
    cached_tokens: int | None = None  # admission count of the first choice
    prompt_logprobs: tuple | None = None
    finished: set[int] = field(default_factory=set)

    async def deltas(self, client: EngineClient, request_id: str) -> AsyncIterator[Item]:
        if self.events is None:
            return
        async for event in self.events:
            if event.choice_index == 0 and self.cached_tokens is None:
                self.cached_tokens = event.num_cached_tokens
            if event.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = event.prompt_logprobs
            choice = self.choices[event.choice_index]
            if event.choice_index in self.finished:
                continue  # events after a string stop, before the abort lands
            delta, events = choice.push(event)
            if delta.finish is not None or choice.failed is not None:
                self.finished.add(event.choice_index)
                if event.finish is None:  # a string stop or a failed tool call: the engine is still going
                    client.abort(request_id, event.choice_index)
            yield self.first_index + event.choice_index, delta, events
            if len(self.finished) == len(self.choices):
                await self.events.aclose()
                return


_ids = itertools.count()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids):08x}"


class Runner:
    """Submits prepared requests and merges their choices' deltas."""

    def __init__(self, frontend: Frontend, client: EngineClient) -> None:
        self.frontend = frontend
        self.client = client
        self.tokens = TokenBytes(frontend.tokenizer)
        self.eos_ids = frozenset(frontend.manifest.tokenizer.eos_token_ids)

    def submit(self, request: InferenceRequest, prompts: list[PreparedPrompt], request_id: str,
               max_tokens: list[int]) -> list[Generation]:  # fmt: skip
        """Validate every child first, then submit them all (one failure submits nothing)."""
        engine_requests = [
            self.frontend.engine_request(request, f"{request_id}.{i}", prompt, limit)
            if limit > 0 or request.logprobs.prompt is not None  # zero tokens: submitted only to score the prompt
            else None
            for i, (prompt, limit) in enumerate(zip(prompts, max_tokens))
        ]
        generations: list[Generation] = []
        try:
            for index, (prompt, engine_request) in enumerate(zip(prompts, engine_requests)):
                choices = [self._choice(request, prompt) for _ in range(request.n)]
                events = self.client.submit(engine_request) if engine_request is not None else None
                generations.append(Generation(prompt, index * request.n, choices, events))
        except BaseException:
            for generation in generations:
                if generation.events is not None:
                    asyncio.ensure_future(generation.events.aclose())
            raise
        return generations

    def _choice(self, request: InferenceRequest, prompt: PreparedPrompt) -> ChoiceStream:
        output = ChoiceOutput(self.tokens, request.stop, request.logprobs, self.eos_ids)
        conversation = request.input if isinstance(request.input, Conversation) else None
        if conversation is None:  # raw prompts bypass reasoning and tool parsers
            return ChoiceStream(output, None, None, frozenset())
        recipe = self.frontend.manifest.recipe
        tools_on = bool(conversation.tools) and conversation.tool_choice.mode != "none"
        parser = None
        if recipe.reasoning_syntax or (recipe.tool_syntax and tools_on):
            parser = build_parser(self.frontend.tokenizer, recipe.reasoning_syntax, recipe.tool_syntax,
                                  prompt.token_ids, tools_on, conversation.tools, request.output is not None)  # fmt: skip
        declared = frozenset(t.name for t in conversation.tools)
        return ChoiceStream(output, parser, conversation.tool_choice, declared)

    async def merged(self, generations: list[Generation], request_id: str) -> AsyncIterator[Item]:
        """Deltas of every generation; one task per generation feeds a shared queue."""
        if len(generations) == 1:
            async for item in generations[0].deltas(self.client, f"{request_id}.0"):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for item in generation.deltas(self.client, f"{request_id}.{index}"):
                    await queue.put(item)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            for generation in generations:
                if generation.events is not None:
                    await generation.events.aclose()


def usage_of(generations: list[Generation]) -> Usage:
    usage = Usage()
    for generation in generations:
        usage.prompt_tokens += len(generation.prompt.token_ids)
        usage.cached_tokens += generation.cached_tokens or 0
        usage.completion_tokens += sum(c.output.num_generated for c in generation.choices)
        usage.reasoning_tokens += sum(c.reasoning_tokens for c in generation.choices)
    return usage
