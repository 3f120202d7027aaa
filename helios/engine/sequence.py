"""One choice of a request as the engine tracks it, and the units a step is planned in.

Only the scheduler changes a Sequence's progress (see scheduler.py for the invariants it keeps);
its memory fields are written only by the memory manager (memory/manager.py), at its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helios.engine.logprobs import TokenLogprobs
from helios.engine.memory.plan import NO_MEMORY_WORK, MemoryPlan
from helios.engine.request import (
    EngineEvent,
    EngineRequest,
    FinishCause,
    TokenConstraint,
)


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, KV pages and sampling state (engine-internal)."""

    request: EngineRequest
    choice_index: int
    token_ids: list[int]  # prompt then generated tokens
    num_prompt: int
    arrival: int  # admission order of its request; larger is newer (preempted first)
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    num_cached: int = 0  # prompt tokens reused from the prefix cache at first admission
    unforked: int = 0  # choices 1..n-1 not yet created (choice 0 only, until its first sample)
    admitted: bool = False  # has run at least once (its num_cached is final)
    finish: FinishCause | None = None
    stop_match_len: int = 0
    prompt_entries: list = field(default_factory=list)  # prompt logprob entries gathered so far
    prompt_chunk_ends: list[int] = field(default_factory=list)  # where each scored prefill chunk ended
    sent_first: bool = False
    reasoning_open: bool = False  # inside reasoning (tracked only for requests with a budget)
    reasoning_tokens: int = 0
    constraint: TokenConstraint | None = None  # this choice's own fork of the request's constraint
    draft_depth: float = 2.0  # adaptive speculation: drafts to offer next round; a new sequence starts shallow
    # Its memory: written only by the memory manager (memory/manager.py); the executor reads the tables.
    pages: list[int] = field(default_factory=list)  # page table: page of positions [i*P, (i+1)*P)
    chain: list[bytes] = field(default_factory=list)  # chain hash of each published full page
    reserved: int = 0  # pages reserved in the pool for this sequence (its growth, its unforked children)
    window_pages: list[int] = field(default_factory=list)  # window-pool cores: window_pages.py (-1: none held)
    window_reserved: int = 0  # window-pool pages reserved for its unforked children's copies
    state_slot: int | None = None  # hybrid cores: its live recurrent-state slot while running (state_slots.py)
    rollback_slot: int | None = None  # hybrid cores: a borrowed slot holding its state before this step's drafts
    endpoint_slot: int | None = None  # hybrid cores: a claimed snapshot slot following its last full page
    endpoint_digest: bytes | None = None  # the chain hash the endpoint slot's state is at
    checkpoints: dict = field(default_factory=dict)  # hybrid cores: boundary -> Checkpoint chosen at admission

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def scoring(self) -> bool:
        """Prompt positions still owe prompt logprobs (scored-prefill program)."""
        return self.request.prompt_logprobs is not None and len(self.prompt_entries) < self.num_prompt

    @property
    def num_choices(self) -> int:
        """Live choices this sequence stands for (itself plus its unforked children)."""
        return 1 + self.unforked


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, start + num_tokens) of `seq` computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    wants_logits: bool  # the chunk ends at the sequence's last token, so it is sampled from
    scored: bool  # prompt positions of a prompt-logprob request (scored-prefill program)
    choices: tuple[Sequence, ...] = ()  # sequences sampling from this chunk's row: seq, then children forked now
    draft_ids: tuple[int, ...] = ()  # speculative tokens after the last one (a decode chunk of one choice only):
    # they are computed at positions start + 1.. and every one of the 1 + len(draft_ids) rows is sampled
    draft_states: tuple = ()  # constrained choices: the constraint before each row (seq's own, then forks
    # advanced through each draft); empty without a constraint

    @property
    def num_rows(self) -> int:
        """Logits rows this chunk asks for: its last token's, plus one per draft."""
        return (1 + len(self.draft_ids)) if self.wants_logits else 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[Chunk, ...]  # invariant: at most one chunk per sequence; every page they touch is allocated
    finished: tuple[EngineEvent, ...] = ()  # sequences planning found could never fit (length cause)
    memory: MemoryPlan = NO_MEMORY_WORK  # the step's copies and restores around the chunks (memory/plan.py)

    @property
    def sequences(self) -> list[Sequence]:
        return [s for chunk in self.chunks for s in (chunk.choices or (chunk.seq,))]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One token the sampler committed for a sequence this step."""

    token_id: int
    logprobs: TokenLogprobs | None  # None when not requested, or for a forced token
    forced: bool = False  # a reasoning-budget close, not a draw


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """The sampled results of one step, keyed by sequence identity."""

    tokens: dict[int, tuple[SampledToken, ...]]  # id(seq) -> committed tokens in order (accepted drafts, then the
    # correction or bonus token; one token without drafts); sequences in sampled chunks only
    errors: dict[int, str] = field(default_factory=dict)  # id(seq) -> why this choice cannot continue
    prompt_entries: dict[int, list] = field(default_factory=dict)  # id(chunk) -> prompt logprob entries
