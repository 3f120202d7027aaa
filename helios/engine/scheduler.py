"""Continuous batching: which tokens of which sequences run in the next step.

Every step mixes one decode token per running sequence with prefill chunks bounded by
`prefill_chunk_size` tokens. A request is admitted only when pages for its whole prompt
are available (after prefix reuse), so prefill never stalls; a decoding sequence that
cannot get a new page finishes with the length cause while the others continue.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from helios.engine.kv_cache import ROOT_HASH, BlockManager, OutOfPages
from helios.engine.request import EngineRequest, FinishCause, TokenConstraint
from helios.engine.sampler import make_generator


class Phase(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, pages and sampling state (engine-internal)."""

    request: EngineRequest
    choice_index: int
    token_ids: list[int]  # prompt then generated tokens
    num_prompt: int
    generator: torch.Generator
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # prompt tokens reused at admission
    chain: list[bytes] = field(default_factory=list)  # chain hash of each published full page
    phase: Phase = Phase.WAITING
    finish: FinishCause | None = None
    stop_match_len: int = 0
    prompt_entries: list = field(default_factory=list)  # prompt logprob entries gathered so far
    sent_first: bool = False
    reasoning_open: bool = False  # inside reasoning (tracked only for requests with a budget)
    reasoning_tokens: int = 0
    constraint: TokenConstraint | None = None  # this choice's own fork of the request's constraint

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, start + num_tokens) of `seq` computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    wants_logits: bool  # the chunk ends at the sequence's last token, so it is sampled from
    scored: bool  # prompt positions of a prompt-logprob request (scored-prefill program)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[Chunk, ...]  # invariant: at most one chunk per sequence
    out_of_pages: tuple[Sequence, ...]  # decoding sequences that could not grow (finish: length)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_concurrency: int  # live sequences (choices) at once
    max_pending: int  # requests waiting for admission; more are refused by the client
    prefill_chunk_size: int  # prefill tokens per step, summed over sequences
    max_model_len: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[Sequence] = []
        self.reused_tokens = 0  # prompt tokens served from the prefix cache, since start

    def add(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        chunks: list[Chunk] = []
        stuck: list[Sequence] = []
        budget = self.config.prefill_chunk_size
        for seq in self.running:
            if seq.prefilling:
                continue
            if not self._ensure_pages(seq, len(seq.token_ids)):
                stuck.append(seq)
                continue
            chunks.append(Chunk(seq, seq.num_computed, 1, wants_logits=True, scored=False))
        for seq in self.running:
            if seq.prefilling and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= chunks[-1].num_tokens
        while self.waiting and budget > 0 and len(self.running) + self.waiting[0].n <= self.config.max_concurrency:
            seq = self._admit(self.waiting[0])
            if seq is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= chunks[-1].num_tokens
        return SchedulerOutput(tuple(chunks), tuple(stuck))

    def _prefill_chunk(self, seq: Sequence, budget: int) -> Chunk:
        size = min(seq.num_prompt - seq.num_computed, budget)
        done = seq.num_computed + size == seq.num_prompt
        scored = seq.request.prompt_logprobs is not None
        return Chunk(seq, seq.num_computed, size, wants_logits=done, scored=scored)

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        try:
            while len(seq.block_table) * self.blocks.page_tokens < num_tokens:
                seq.block_table.append(self.blocks.allocate())
        except OutOfPages:
            return False
        return True

    def _admit(self, request: EngineRequest) -> Sequence | None:
        """Reserve pages for the prompt (after prefix reuse) and the choices' private pages."""
        prompt = request.prompt_ids
        size = self.blocks.page_tokens
        pages: list[int] = []
        chain_end = ROOT_HASH
        if request.use_prefix_cache and request.prompt_logprobs is None:
            # At least the last prompt token is computed: its logits start generation.
            pages, chain_end = self.blocks.match_prefix(prompt, request.cache_identity, (len(prompt) - 1) // size)
        needed = self.blocks.pages_for(len(prompt)) - len(pages) + (request.n - 1)
        if needed > self.blocks.num_free:
            self.blocks.release(pages)
            return None
        seq = Sequence(request, 0, list(prompt), len(prompt), make_generator(request.params[0].seed))
        seq.reasoning_open = request.reasoning_budget is not None
        seq.constraint = request.constraint.fork() if request.constraint is not None else None
        seq.block_table = pages
        seq.num_computed = seq.num_cached = len(pages) * size
        self.reused_tokens += seq.num_cached
        seq.chain = self._chain_of(prompt, request.cache_identity, len(pages), chain_end)
        seq.phase = Phase.RUNNING
        ok = self._ensure_pages(seq, len(prompt))
        assert ok, "pages were counted before allocation"
        return seq

    def _chain_of(self, prompt: tuple[int, ...], identity: bytes, num_pages: int, end: bytes) -> list[bytes]:
        from helios.engine.kv_cache import page_hash

        chain, parent, size = [], ROOT_HASH, self.blocks.page_tokens
        for index in range(num_pages):
            parent = page_hash(parent, identity, tuple(prompt[index * size : (index + 1) * size]))
            chain.append(parent)
        assert not chain or chain[-1] == end
        return chain

    def publish_full_pages(self, seq: Sequence) -> None:
        """Register every newly computed full page of `seq` in the prefix cache."""
        size = self.blocks.page_tokens
        identity = seq.request.cache_identity
        while (len(seq.chain) + 1) * size <= seq.num_computed:
            index = len(seq.chain)
            parent = seq.chain[-1] if seq.chain else ROOT_HASH
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            seq.chain.append(self.blocks.publish(seq.block_table[index], parent, identity, tokens))

    def fork(self, parent: Sequence, copy_page) -> list[Sequence]:
        """Children 1..n-1 of a request whose prompt just finished prefill.

        Full pages are shared; the partial last page is copied (copy_page(src, dst)).
        """
        children = []
        size = self.blocks.page_tokens
        for index in range(1, parent.request.n):
            child = Sequence(parent.request, index, list(parent.token_ids), parent.num_prompt,
                             make_generator(parent.request.params[index].seed))  # fmt: skip
            full = parent.num_computed // size
            for page in parent.block_table[:full]:
                self.blocks.share(page)
            child.block_table = list(parent.block_table[:full])
            if len(parent.block_table) > full:
                page = self.blocks.allocate()  # reserved at admission
                copy_page(parent.block_table[full], page)
                child.block_table.append(page)
            child.num_computed, child.num_cached = parent.num_computed, parent.num_cached
            child.chain = list(parent.chain)
            child.prompt_entries = parent.prompt_entries
            child.reasoning_open = parent.reasoning_open
            child.constraint = parent.request.constraint.fork() if parent.request.constraint is not None else None
            child.phase = Phase.RUNNING
            children.append(child)
        self.running.extend(children)
        return children

    def finish(self, seq: Sequence, cause: FinishCause) -> None:
        seq.phase = Phase.FINISHED
        seq.finish = cause
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if seq in self.running:
            self.running.remove(seq)
