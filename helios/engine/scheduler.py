"""Continuous batching with preemption: the only code that changes a sequence's state. Its
memory (pages, window pages, state slots, snapshots, host-store copies) is drawn from and given
back to one memory manager (memory/manager.py); draft planning is the drafter's (drafter.py).

A step is schedule() -> the engine runs the plan -> update_from_output().

Invariants (each checked by tests/engine/test_scheduler.py without a model):
* A sequence is in exactly one of `waiting` (new, or preempted), `running`, or finished.
* Admission takes every page a sequence's tokens need (after prefix reuse) and reserves
  what each of its choices needs to commit one more token; forks and first growth draw on
  that reservation, so an admitted request always makes progress.
* A running sequence that cannot grow preempts the newest running sequences (their memory is
  released, their tokens, sampler and constraint state kept); preempted sequences go back to
  the front of the queue and are recomputed, reusing their published pages from the prefix
  cache where those survive. Only a sequence that alone fills the pool stops with the length
  cause; other requests' load never shortens an output.
* Every finish (stop, length, abort, error) releases the sequence's memory (MemoryManager.release).
* Draft state (history indexes, a learned drafter's proposals and progress) is dropped at every
  finish and, for the learned drafter, at preemption (Drafter.finished / preempted); a learned
  drafter's KV lives on the sequence's own pages, so it goes with them.
* Hybrid cores: prefill chunks end at snapshot boundaries (MemoryManager.cut_prefill). A drafting
  sequence borrows a rollback slot for the step; a rejection rewinds num_computed to the round's
  first position, so the next step recomputes the committed tokens without the rejected ones.
* Window-pool cores: a prefill chunk is cut to the window pages the pool has left
  (MemoryManager.coverable); pages behind the window are trimmed after every step.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from helios.engine.memory.checkpoints import StepCosts
from helios.engine.memory.copy_out import CopyOut
from helios.engine.memory.host_copy import Copier
from helios.engine.memory.host_store import HostStore
from helios.engine.memory.kv_cache import PagePool
from helios.engine.memory.manager import MemoryConfig, MemoryManager, Release
from helios.engine.memory.state_slots import StatePool
from helios.engine.memory.window_pages import WindowPages
from helios.engine.request import EngineEvent, EngineRequest, EngineStats, FinishCause
from helios.engine.sequence import Chunk, ModelOutput, SampledToken, SchedulerOutput, Sequence
from helios.engine.speculation.drafter import Drafter, SpeculationConfig

__all__ = ["Scheduler", "SchedulerConfig", "Sequence", "constraint_error"]  # Sequence: frontend/constraint.py


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_concurrency: int  # live sequences (choices) at once
    prefill_chunk_size: int  # prefill tokens per step, summed over sequences
    max_model_len: int
    eos_ids: frozenset[int] = frozenset()
    # Hybrid cores: state snapshots are taken at prompt positions that are multiples of this
    # (a multiple of the page size), and at the prompt's last page boundary; 0: only there.
    snapshot_interval: int = 0
    # Hybrid cores: hinted snapshots (EngineRequest.checkpoint_hints) may add at most this fraction
    # of the request's predicted prefill time in predicted extra work; 0: none off the planned boundaries.
    checkpoint_work_fraction: float = 0.05
    # Cores whose image tokens attend each other both ways (attention_until): a prefill chunk never
    # ends inside an image, so all of its keys are written before any of its tokens attends.
    whole_images: bool = False


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: PagePool,
        stats: EngineStats | None = None,
        speculation: SpeculationConfig | None = None,
        states: StatePool | None = None,
        host: HostStore | None = None,
        host_page_bytes: int = 0,
        costs: StepCosts | None = None,
        copier: Copier | None = None,
        copy_queue_bytes: int = 256 << 20,
        window: WindowPages | None = None,
    ) -> None:
        self.config = config
        self.stats = (
            stats if stats is not None else EngineStats(total_pages=pool.num_pages, page_tokens=pool.page_tokens)
        )
        memory = MemoryConfig(
            config.prefill_chunk_size,
            config.snapshot_interval,
            config.checkpoint_work_fraction,
            host_page_bytes,
            copy_queue_bytes,
        )
        self.memory = MemoryManager(
            memory, pool, self.stats, self._next_step_pages, states, window, host, copier, costs
        )
        self.drafter = Drafter(speculation or SpeculationConfig(mode="off"), self.stats, config.max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_prefetch = False  # the last plan left the queue's head waiting for its host-store prefetch
        self._arrivals = itertools.count()
        self._forked: list[Sequence] = []  # children created while planning; they join `running` after it
        self._planned_finishes: list[EngineEvent] = []  # finishes decided while planning this step

    # The memory systems, as the engine, its metrics and tests read them.
    @property
    def pool(self) -> PagePool:
        return self.memory.pool

    @property
    def states(self) -> StatePool | None:
        return self.memory.states

    @property
    def window(self) -> WindowPages | None:
        return self.memory.window

    @property
    def host(self) -> HostStore | None:
        return self.memory.host

    @property
    def copy_out(self) -> CopyOut:
        return self.memory.copy_out

    def _next_step_pages(self) -> int:
        """Pages the next step may need: one to grow each running sequence, and what the head of
        the queue needs to be admitted (copy-out pins never eat into them)."""
        need = sum(1 for seq in self.running if seq.finish is None)
        if self.waiting:
            head = self.waiting[0]
            need += self.memory.pages_for(len(head.token_ids)) + head.unforked
        return need

    # ------------------------------------------------------------------ requests
    def add(self, request: EngineRequest) -> None:
        seq = Sequence(
            request, 0, list(request.prompt_ids), len(request.prompt_ids), next(self._arrivals), unforked=request.n - 1
        )
        seq.reasoning_open = request.reasoning_budget is not None
        seq.constraint = request.constraint.fork() if request.constraint is not None else None
        self.waiting.append(seq)

    def min_pages(self, request: EngineRequest) -> int:
        """Pages the request needs to commit one token per choice in an otherwise empty pool."""
        return self.memory.min_pages(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        chunks: list[Chunk] = []
        budget = self.config.prefill_chunk_size
        preemptions_before = self.stats.preemptions
        index = 0
        spare = self.drafter.rows(self.running)
        while index < len(self.running):  # oldest first; victims come off the tail, not yet planned
            seq = self.running[index]
            if seq.num_pending == 1 and not seq.scoring:
                if not self._grow(seq):
                    continue  # seq itself was preempted or finished: the list shifted
                drafts, states = self.drafter.plan(seq, spare, self.memory, keep_free=len(self.running))
                spare -= len(drafts)
                chunks.append(self._chunk(seq, seq.num_computed, 1, drafts, states))
                self.memory.decoding(seq)
            elif budget > 0 and seq.num_pending > 0:
                chunk = self._prefill_chunk(seq, budget)
                if chunk is not None:  # None: the window pool has no page for it this step
                    chunks.append(chunk)
                    budget -= chunk.num_tokens
            index += 1
        preempted = self.stats.preemptions != preemptions_before
        self.awaiting_prefetch = False
        while self.waiting and budget > 0 and not preempted:  # no re-admission into a pool just found short
            head = self.waiting[0]
            if self.host is not None and self.host.prefetching(head.request.request_id):
                # Its disk records are being read off this thread: admitted once they are in memory
                # (running sequences keep stepping meanwhile).
                self.awaiting_prefetch = True
                break
            # Running parents count their unforked children: they take a slot when they fork.
            live = sum(s.num_choices for s in self.running) + len(self._forked)
            if live + head.num_choices > self.config.max_concurrency:
                break
            if not self._admit(head, budget):
                if not self.running and not self._forked:  # even an empty pool cannot hold it
                    self.waiting.popleft()
                    self._finish_alone(head)
                    continue
                break
            self.waiting.popleft()
            self.running.append(head)
            chunk = self._prefill_chunk(head, budget)
            assert chunk is not None, "admission secured the first chunk's window pages"
            chunks.append(chunk)
            budget -= chunk.num_tokens
        self.running += self._forked
        self._forked = []
        finished, self._planned_finishes = tuple(self._planned_finishes), []
        return SchedulerOutput(tuple(chunks), finished, self.memory.take_plan())

    def _prefill_chunk(self, seq: Sequence, budget: int) -> Chunk | None:
        start = seq.num_computed
        end = self._whole_images(seq, start, start + min(seq.num_pending, budget))
        cut = self.memory.coverable(seq, end)  # the window pages the pool has left (never below one token)
        if cut < end:
            end = self._whole_images(seq, start, cut)
            if end > cut or end <= start:  # the pages left end inside an image it must finish: wait
                return None
        end = self.memory.cut_prefill(seq, end)  # at a snapshot boundary, so its state can be captured
        return self._chunk(seq, start, end - start)

    def _whole_images(self, seq: Sequence, start: int, end: int) -> int:
        """A chunk's end moved off any image it would split (whole_images cores): back to the image's
        start, or, when the chunk starts inside or at the image, on to its end (past the budget)."""
        if not self.config.whole_images:
            return end
        for image in seq.request.images:
            for first, _, rows in image.spans():
                if first < end < first + rows:
                    end = first if first > start else first + rows
        return end

    def _chunk(self, seq: Sequence, start: int, size: int, drafts: tuple[int, ...] = (), states: tuple = ()) -> Chunk:
        wants = start + size == len(seq.token_ids)
        self.memory.cover(seq, start + size + len(drafts))
        choices: tuple[Sequence, ...] = (seq,)
        if wants and seq.unforked and seq.request.max_tokens > 0:
            choices += tuple(self._fork(seq, start + size))
        return Chunk(seq, start, size, wants, seq.scoring, choices, drafts, states)

    def learned_depths(self) -> dict[int, int]:
        """id(seq) -> drafts the learned drafter should propose after this step (Drafter.depths)."""
        return self.drafter.depths(self.running, self.memory)

    def _grow(self, seq: Sequence) -> bool:
        """Memory for one more token of `seq`, preempting newer sequences; False when seq left running."""
        while not self.memory.grow(seq):
            if not self._make_room(seq):
                return False
        return True

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the newest running sequence for seq's growth; False when that was seq itself (or
        it could not fit even alone, and finished)."""
        victim = self.running[-1]
        if victim is seq and len(self.running) == 1 and not self._forked:
            self._finish_alone(seq)
            return False
        self._preempt(victim)
        return victim is not seq

    def _preempt(self, seq: Sequence) -> None:
        """Release seq's memory and queue it first; its tokens and sampling state are kept."""
        self.running.remove(seq)
        self.drafter.preempted(seq)
        self.memory.release(seq, Release.PREEMPT)
        seq.num_computed = 0
        if seq.scoring:
            seq.prompt_entries, seq.prompt_chunk_ends = [], []  # scored prefill is replayed from the start
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _finish_alone(self, seq: Sequence) -> None:
        """A sequence that cannot fit even an otherwise empty pool (spec: past page capacity)."""
        self._planned_finishes += self._finish_all(seq, FinishCause.LENGTH)

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Memory for seq's tokens (after prefix reuse) and its choices' next pages."""
        reused = self.memory.admit(
            seq, lambda start: self._whole_images(seq, start, start + min(len(seq.token_ids) - start, budget))
        )
        if reused is None:
            return False
        seq.num_computed = reused
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached = reused
            reused_images = sum(1 for image in seq.request.images if image.end <= reused)
            if reused_images:
                self.stats.images["input_reused_images_total"] += reused_images
        return True

    def _fork(self, parent: Sequence, computed: int) -> list[Sequence]:
        """Children 1..n-1 of a parent whose prompt finishes this step; they sample from its row
        and hold its memory's share (MemoryManager.fork)."""
        children = []
        for index in range(1, parent.unforked + 1):
            child = Sequence(parent.request, index, list(parent.token_ids), parent.num_prompt, parent.arrival)
            self.memory.fork(parent, child, computed)
            child.num_computed, child.num_cached, child.admitted = computed, parent.num_cached, True
            child.prompt_entries, child.prompt_chunk_ends = parent.prompt_entries, parent.prompt_chunk_ends
            child.reasoning_open = parent.reasoning_open
            child.constraint = parent.request.constraint.fork() if parent.request.constraint is not None else None
            children.append(child)
        parent.unforked = 0
        self._forked += children
        return children

    # ------------------------------------------------------------------ results
    def update_from_output(self, plan: SchedulerOutput, output: ModelOutput) -> list[EngineEvent]:
        """Commit a step: computed positions, published pages, sampled tokens, stops and finishes."""
        return self.commit_positions(plan, output.prompt_entries) + self.commit_tokens(plan, output)

    def commit_positions(self, plan: SchedulerOutput, prompt_entries: dict[int, list]) -> list[EngineEvent]:
        """The first half of update_from_output, which needs none of the sampled tokens: the positions
        the step computed, their published pages, prompt logprob entries. Async output handling
        (helios.engine.overlap) calls it before the step's tokens are on the host."""
        events: list[EngineEvent] = []
        self.memory.step_ran(plan.memory)  # the step ran, so the copies after it were made
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.finish is not None:
                continue
            end = chunk.start + chunk.num_tokens
            if chunk.start < seq.num_prompt:
                self.stats.prefill_tokens += min(end, seq.num_prompt) - chunk.start
            seq.num_computed = end
            self.memory.commit(seq)
            entries = prompt_entries.get(id(chunk))
            if entries is not None:
                seq.prompt_entries.extend(entries)
                seq.prompt_chunk_ends.append(min(end, seq.num_prompt))
            if chunk.wants_logits and seq.request.max_tokens == 0:  # prompt scoring only: no output
                events += self._finish_all(seq, FinishCause.LENGTH)
        return events

    def commit_tokens(self, plan: SchedulerOutput, output: ModelOutput) -> list[EngineEvent]:
        """The second half of update_from_output: sampled tokens, stops and finishes. A sequence that
        has left `running` since the step was planned (finished, or preempted while async output
        handling planned the next step) takes its tokens like any other unless it finished."""
        events: list[EngineEvent] = []
        drafts = {id(chunk.seq): len(chunk.draft_ids) for chunk in plan.chunks if chunk.draft_ids}
        for seq in plan.sequences:
            if seq.finish is not None:
                continue
            error = output.errors.get(id(seq))
            if error is not None:
                events += self._finish_all(seq, FinishCause.ERROR, error)
                continue
            sampled = output.tokens.get(id(seq))
            if sampled is not None:
                events += self._commit(seq, sampled, drafts.get(id(seq), 0))
        self.memory.trim_windows(self.running)
        return events

    def _commit(self, seq: Sequence, sampled: tuple[SampledToken, ...], offered: int) -> list[EngineEvent]:
        """Append a round's tokens: the accepted drafts, then the correction or bonus token; a
        stop among them ends the round there (what followed it was never generated)."""
        stats = self.stats
        if seq.num_output > 0:  # a decode round (the first token comes from prefill)
            stats.verification_rounds += 1
            stats.verification_drafts += offered
            stats.draft_rounds += offered > 0
            stats.count_round(offered)
        accepted = len(sampled) - 1  # every token before the last matched its draft
        round_start = seq.num_computed - 1  # the chunk's position (its one token, before the drafts)
        stats.accepted_drafts += accepted
        self.drafter.verified(seq, offered, accepted)
        tokens: list[int] = []
        entries: list = []
        cause, rejected = None, False
        for item in sampled:
            token = item.token_id
            seq.token_ids.append(token)
            tokens.append(token)
            entries.append(item.logprobs)
            stats.generated_tokens += 1
            self._track_reasoning(seq, item)
            rejected = seq.constraint is not None and not seq.constraint.advance(token)  # forced tokens too
            cause = self._stop_cause(seq, token)
            if cause is not None or rejected:
                break
        events = [self._event(seq, tuple(tokens), tuple(entries), cause)]
        if cause is not None:
            self._finish(seq, cause)
        elif rejected:
            events += self._finish_all(seq, FinishCause.ERROR, constraint_error(seq))
        else:
            seq.num_computed += accepted  # the accepted drafts' KV was written by this step
            self.memory.commit(seq)
            self.drafter.accepted(seq, offered, accepted)
            if self.memory.settle_round(seq, rejected=accepted < offered):
                seq.num_computed = round_start  # the live state absorbed a rejected draft: recompute
        return events

    def _track_reasoning(self, seq: Sequence, sampled: SampledToken) -> None:
        budget = seq.request.reasoning_budget
        if sampled.forced:
            seq.reasoning_open = False
            self.stats.reasoning_budget_cuts += 1
        elif budget is not None:
            if sampled.token_id == budget.close_id or sampled.token_id in budget.implicit_close_ids:
                seq.reasoning_open = False
            elif seq.reasoning_open:
                seq.reasoning_tokens += 1

    def _stop_cause(self, seq: Sequence, token: int) -> FinishCause | None:
        request = seq.request
        if token in self.config.eos_ids and not request.ignore_eos:
            return FinishCause.EOS
        if token in request.stop_token_ids:
            seq.stop_match_len = 1
            return FinishCause.STOP_TOKEN
        output = seq.output_ids
        for stop in request.stop_token_sequences:
            if len(output) >= len(stop) and tuple(output[-len(stop) :]) == stop:
                seq.stop_match_len = len(stop)
                return FinishCause.STOP_TOKEN
        if seq.num_output >= request.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return FinishCause.LENGTH
        return None

    # ------------------------------------------------------------------ finishing
    def fail(self, plan: SchedulerOutput, error: str) -> list[EngineEvent]:
        """A step that could not run: every sequence in it fails; the others are untouched."""
        events: list[EngineEvent] = []
        for seq in plan.sequences:
            if seq.finish is None:
                events += self._finish_all(seq, FinishCause.ERROR, error)
        self.memory.step_failed(plan.memory)
        return events

    def abort(self, doomed: set[tuple[str, int | None]]) -> list[EngineEvent]:
        """Cancel whole requests ((id, None)) or single choices ((id, index))."""

        def hit(seq: Sequence) -> bool:
            rid = seq.request.request_id
            return (rid, None) in doomed or (rid, seq.choice_index) in doomed

        events: list[EngineEvent] = []
        for seq in [s for s in itertools.chain(self.running, self.waiting) if hit(s)]:
            events += self._finish_all(seq, FinishCause.ABORT)
        return events

    def _finish_all(self, seq: Sequence, cause: FinishCause, error: str | None = None) -> list[EngineEvent]:
        """Finish seq and the children it has not forked yet (they share its fate)."""
        events = [self._event(seq, (), (), cause, error)]
        events += [
            EngineEvent(
                seq.request.request_id,
                index,
                (),
                () if seq.request.num_top_logprobs is not None else None,
                cause,
                seq.num_prompt,
                seq.num_cached,
                0,
                None,
                error,
            )
            for index in range(seq.choice_index + 1, seq.choice_index + 1 + seq.unforked)
        ]
        self._count(cause, seq.num_choices)
        self._finish(seq, cause, count=False)
        return events

    def _finish(self, seq: Sequence, cause: FinishCause, count: bool = True) -> None:
        if count:
            self._count(cause, 1)
        seq.finish = cause
        seq.unforked = 0
        self.drafter.finished(seq)
        # Its published prefix is offered to the host store before its pages go (MemoryManager.release).
        self.memory.release(seq, Release.ERROR if cause is FinishCause.ERROR else Release.FINISH)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _count(self, cause: FinishCause, choices: int) -> None:
        if cause is FinishCause.ERROR:
            self.stats.failed += choices
        elif cause is not FinishCause.ABORT:
            self.stats.completed += choices

    def _event(
        self,
        seq: Sequence,
        tokens: tuple[int, ...],
        entries: tuple,
        cause: FinishCause | None,
        error: str | None = None,
    ) -> EngineEvent:
        first = not seq.sent_first
        seq.sent_first = True
        request = seq.request
        return EngineEvent(
            request_id=request.request_id,
            choice_index=seq.choice_index,
            token_ids=tokens,
            logprobs=entries if request.num_top_logprobs is not None else None,
            finish=cause,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            stop_match_len=seq.stop_match_len,
            prompt_logprobs=tuple(seq.prompt_entries) if first and request.prompt_logprobs is not None else None,
            prompt_chunk_ends=tuple(seq.prompt_chunk_ends) if first and request.prompt_logprobs is not None else None,
            error=error,
        )

    def check_invariants(self) -> None:
        """Sequences and their memory add up (tests; cheap enough to call after every step there)."""
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "a sequence is running and waiting"
        self.memory.check(self.running, list(self.waiting))


def constraint_error(seq: Sequence) -> str:
    reason = seq.constraint.error if seq.constraint is not None else None
    return f"output constraint failed: {reason or 'no token is allowed'}"
