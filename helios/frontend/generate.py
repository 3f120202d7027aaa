"""Running a prepared request on the engine and turning its events into typed choice updates.

One `Generation` per submitted prompt (its n choices share the prompt's prefill). Every
engine event of a choice becomes one `ChoiceUpdate`; `Runner.merged` interleaves a
request's generations, and the server's driver hands the updates to a protocol encoder.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from helios.engine import EngineClient, EngineEvent
from helios.frontend.choice import ChoiceStream
from helios.frontend.detokenizer import IncrementalDecoder, TokenBytes
from helios.frontend.events import FinishEvent, ReasoningEvent, SemanticEvent, TextEvent, ToolCallEvent
from helios.frontend.inference import Conversation, InferenceRequest, Termination
from helios.frontend.output import ChoiceOutput, OutputDelta
from helios.frontend.parsers import build_parser
from helios.frontend.prepare import Prepared
from helios.frontend.prompt import PreparedPrompt
from helios.frontend.request import Frontend


@dataclass(frozen=True, slots=True)
class ChoiceUpdate:
    """What one engine event (or a zero-token choice's end) produced for one choice."""

    index: int  # global choice index: prompt_index * n + choice_index
    delta: OutputDelta  # raw text, logprob entries and token ids this event settled
    events: tuple[SemanticEvent, ...]  # parsed output in order; a FinishEvent, if any, is last
    observed: float  # Unix time (s) the engine event reached the frontend: its tokens' timestamp

    @property
    def finish(self) -> FinishEvent | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, FinishEvent) else None

    @property
    def error(self) -> str | None:
        """The failure message when this update ends its choice with an error."""
        finish = self.finish
        if finish is None or finish.termination is not Termination.ERROR:
            return None
        return finish.error or "generation failed"

    @property
    def offers_output(self) -> bool:
        """Whether a client sees answer or reasoning text (or a tool call) here (first-response metric)."""
        return any(
            isinstance(e, ToolCallEvent) or (isinstance(e, (TextEvent, ReasoningEvent)) and e.text) for e in self.events
        )


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused at admission (first choice of each prompt)
    reasoning_tokens: int = 0  # generated tokens the output pipeline published as reasoning
    image_tokens: int = 0  # image feature tokens inside prompt_tokens (framing excluded)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_ZERO_TOKENS = OutputDelta("", (), (), Termination.LENGTH, None, None)


@dataclass(eq=False)
class Generation:
    """The choices of one prompt, as they come out of the engine."""

    prompt: PreparedPrompt
    first_index: int  # global choice index of this prompt's first choice
    request_id: str  # the engine request of this prompt's choices
    choices: list[ChoiceStream]
    events: AsyncIterator[EngineEvent] | None  # None: nothing submitted (max_tokens 0)
    engine_choices: int  # choices the engine runs: n, or 1 when only the prompt is scored
    echo: str = ""  # the prompt as echoed (raw completions with echo)
    echo_offsets: tuple[int, ...] = ()  # with echo and logprobs: each prompt token's character offset in `echo`
    cached_tokens: int | None = None  # admission count of the first choice
    prompt_logprobs: tuple | None = None
    prompt_chunk_ends: tuple[int, ...] = ()  # where the engine's scored prefill chunks ended
    finished: set[int] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.choices)

    async def updates(self, client: EngineClient) -> AsyncIterator[ChoiceUpdate]:
        if self.events is not None:
            async for event in self.events:
                update = self._push(event, client)
                if update is not None:
                    yield update
                if len(self.finished) >= self.engine_choices:
                    await self.events.aclose()
                    break
        # Choices the engine never ran end with zero tokens, as the scored one did.
        for j in range(len(self.choices)):
            if j not in self.finished:
                self.finished.add(j)
                yield ChoiceUpdate(self.first_index + j, _ZERO_TOKENS, (FinishEvent(Termination.LENGTH),), time.time())

    def _push(self, event: EngineEvent, client: EngineClient) -> ChoiceUpdate | None:
        if event.choice_index == 0 and self.cached_tokens is None:
            self.cached_tokens = event.num_cached_tokens
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
            self.prompt_chunk_ends = event.prompt_chunk_ends or ()
        if event.choice_index in self.finished:
            return None  # events after a string stop, before the abort lands
        choice = self.choices[event.choice_index]
        delta, events = choice.push(event)
        if delta.finish is not None or choice.failed is not None:
            self.finished.add(event.choice_index)
            if event.finish is None:  # a string stop or a failed tool call: the engine is still going
                client.abort(self.request_id, event.choice_index)
        return ChoiceUpdate(self.first_index + event.choice_index, delta, tuple(events), time.time())


_ids = itertools.count()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids):08x}"


@dataclass(eq=False)
class Submission:
    """One submitted request: its generations, in prompt order."""

    request: InferenceRequest
    request_id: str
    generations: list[Generation]
    created: int = field(default_factory=lambda: int(time.time()))  # Unix seconds, as the wire reports it

    def usage(self) -> Usage:
        return usage_of(self.generations)

    def generation_of(self, index: int) -> Generation:
        """The generation holding global choice `index`."""
        return self.generations[index // self.request.n]


class Runner:
    """Submits prepared requests and merges their choices' updates."""

    def __init__(self, frontend: Frontend, client: EngineClient) -> None:
        self.frontend = frontend
        self.client = client
        self.tokens = TokenBytes(frontend.tokenizer)
        self.eos_ids = frozenset(frontend.manifest.tokenizer.eos_token_ids)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens spelled out (logprob and echo strings)."""
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)

    def echo_offsets(self, prompt: PreparedPrompt, echo: str) -> tuple[int, ...]:
        """Each prompt token's text_offset in the echoed text: the decoded characters before it,
        whatever string the token is shown as (token_id:N included). Aligned so that the prompt
        ends where the echo does: a BOS the tokenizer spells out but the echo lacks takes no
        characters, and generated offsets, which start after the echo, never go backwards."""
        decoder = IncrementalDecoder()
        starts, position = [], 0
        for token_id in prompt.token_ids:
            starts.append(position)
            position += len(decoder.push(self.tokens.bytes_of(token_id)))
        excess = position - len(echo)
        return tuple(max(0, start - excess) for start in starts)

    def echo_text(self, prompt: PreparedPrompt) -> str:
        """The original prompt text, or the token-id prompt decoded."""
        if prompt.text is not None:
            return prompt.text
        return b"".join(self.tokens.bytes_of(t) for t in prompt.token_ids).decode("utf-8", "replace")

    def submit(self, prepared: Prepared) -> Submission:
        """Submit every prepared prompt as one group, all or nothing: every child is checked, and
        the group queued at once, before any runs (a refused child leaves nothing queued)."""
        request = prepared.request
        children = [  # everything that can fail is built before anything is queued
            (
                child,
                [self._choice(request, child.prompt) for _ in range(request.n)],
                self.echo_text(child.prompt) if request.echo else "",
            )
            for child in prepared.inputs
        ]
        engines = [child.engine for child, _, _ in children if child.engine is not None]
        streams = iter(self.client.submit_group(engines) if engines else ())
        generations = [
            Generation(
                child.prompt,
                index * request.n,
                f"{prepared.request_id}.{index}",
                choices,
                next(streams) if child.engine is not None else None,
                child.engine.n if child.engine is not None else 0,
                echo,
                self.echo_offsets(child.prompt, echo) if request.echo and request.logprobs.top is not None else (),
            )
            for index, (child, choices, echo) in enumerate(children)
        ]
        return Submission(request, prepared.request_id, generations)

    def _choice(self, request: InferenceRequest, prompt: PreparedPrompt) -> ChoiceStream:
        output = ChoiceOutput(self.tokens, request.stop, request.logprobs, self.eos_ids)
        conversation = request.input if isinstance(request.input, Conversation) else None
        if conversation is None:  # raw prompts bypass reasoning and tool parsers
            return ChoiceStream(output, None, None, frozenset())
        recipe = self.frontend.manifest.recipe
        tools_on = bool(conversation.tools) and conversation.tool_choice.mode != "none"
        parser = None
        if recipe.reasoning_syntax or (recipe.tool_syntax and tools_on):
            parser = build_parser(
                self.frontend.tokenizer,
                recipe.reasoning_syntax,
                recipe.tool_syntax,
                prompt.token_ids,
                tools_on,
                conversation.tools,
                request.output is not None,
            )
        declared = frozenset(t.name for t in conversation.tools)
        return ChoiceStream(output, parser, conversation.tool_choice, declared)

    def abort(self, generations: list[Generation]) -> None:
        """Abort every child the engine may still be running (harmless for finished ones)."""
        for generation in generations:
            if generation.events is not None and not generation.done:
                self.client.abort(generation.request_id)

    async def merged(self, generations: list[Generation]) -> AsyncIterator[ChoiceUpdate]:
        """Every generation's updates in arrival order (one task per generation when several).

        Leaving early, or being cancelled, aborts every unfinished child in the engine, even
        one whose event iterator never started (closing that would run none of its code).
        """
        tasks: list[asyncio.Task] = []
        try:
            if len(generations) == 1:
                async with aclosing(generations[0].updates(self.client)) as updates:
                    async for update in updates:
                        yield update
                return
            queue: asyncio.Queue = asyncio.Queue()
            done = object()

            async def pump(generation: Generation) -> None:
                try:
                    async for update in generation.updates(self.client):
                        queue.put_nowait(update)
                except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
                    queue.put_nowait(exc)
                finally:
                    queue.put_nowait(done)

            tasks = [asyncio.create_task(pump(g)) for g in generations]
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            self.abort(generations)


def usage_of(generations: list[Generation]) -> Usage:
    prompt = cached = completion = reasoning = image = 0
    for generation in generations:
        prompt += len(generation.prompt.token_ids)
        image += generation.prompt.image_tokens
        cached += generation.cached_tokens or 0
        completion += sum(c.output.num_generated for c in generation.choices)
        reasoning += sum(c.reasoning_tokens for c in generation.choices)
    return Usage(prompt, completion, cached, reasoning, image)
