"""Async output handling (vLLM v1's model): plan and launch step k+1 before reading step k's tokens.

Without it a step is plan -> run -> sample -> copy to the host -> commit, and the device idles
while the host plans, detokenizes and stops sequences. With it (EngineConfig.async_output) the
engine keeps one step in flight (`InFlight`): step k's sampled ids stay on the device and their
one copy to the host (step_output.fetch_start) is read only after step k+1 has been launched, so
the host's work on step k overlaps the device's on step k+1.

How step k+1 is planned without step k's tokens (`advance`):
* step k's computed positions are committed first (Scheduler.commit_positions: they do not
  depend on its tokens);
* each sequence sampled in step k gets a placeholder token -(1 + i), where i is its sampling row:
  the executor replaces it on the device with step k's i-th sampled id (Executor.run's `fed`);
* a sequence certain to finish with step k's token (max_tokens, the context limit) gets none and
  is not planned again; nor does one whose next position fits no pool, so that its token is
  committed before planning finishes it by length, as without overlap. One that stops on a token
  (EOS, a stop token or sequence) is found only when step k's tokens are read: step k+1 computed
  one more token for it, which is dropped (never emitted); its pages were freed when it finished,
  and what step k+1 wrote there lies past every published page.

A step overlaps only when nothing in the next one needs its tokens on the host (`overlaps`):
draft verification (speculation: the next round's drafts follow the accepted tokens), grammar
masks (the matcher must advance first), reasoning budgets (the forced close is decided on the
host), penalties (they count the output so far), prompt scoring, and choices that asked for every
alternative the core returns (their tie test may read the logits row again, which the next step's
graph replay overwrites) keep the synchronous path; so do engines with a drafter, host embedding
tables (their row cache reads the token ids on the host) or recurrent state (snapshots follow the
committed tokens). A pending abort first completes the step in flight, so cancellation sees
exactly the tokens it would without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helios.engine import step_output
from helios.engine.executor import StepResult
from helios.engine.request import EngineEvent
from helios.engine.scheduler import Scheduler
from helios.engine.sequence import SchedulerOutput, Sequence


@dataclass(slots=True)
class Sampling:
    """A step's sampling rows, drawn on the device, with their copy to the host started."""

    rows: list[int]  # the output row each sampling row reads
    seqs: list[Sequence]  # the choice of each sampling row
    prefixes: list[tuple[int, ...]]  # the drafts each row samples after
    masked: list[object]  # what the mask hook read per row
    drafts: dict[int, tuple[int, ...]]  # id(seq) -> drafts offered this round
    allowed: torch.Tensor | None  # the rows' grammar masks (host), or None
    blocked: set[int]  # rows whose mask allowed nothing
    sampled: torch.Tensor | None  # [len(rows)] sampled ids on the device (None without rows)
    fetch: step_output.PendingFetch  # the step's one copy to the host, started


@dataclass(slots=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    plan: SchedulerOutput
    result: StepResult
    sampling: Sampling
    started: int  # perf_counter_ns at launch
    host_ns: int  # the launch's wall time (run and sample)
    restored_ns: int  # its host-store restores' time
    timers: list = field(default_factory=list)  # CUDA: its programs' timing events (Executor.take_timers)
    placeholders: list[Sequence] = field(default_factory=list)  # sequences holding a placeholder token
    advanced: bool = False  # its positions are committed and its placeholders placed (advance)


def enabled(wanted: bool | None, device: str) -> bool:
    """Whether async output handling is on: as configured, else on every device but the CPU, where
    the 'device' is the host's own cores and launching ahead gains nothing (docs/performance.md)."""
    return wanted if wanted is not None else device != "cpu"


def overlaps(plan: SchedulerOutput, sampling: Sampling, result: StepResult) -> bool:
    """Whether the next step may be planned before this one's tokens are read (the module's list)."""
    if any(chunk.scored or chunk.draft_ids for chunk in plan.chunks) or result.prompt_scores:
        return False
    width = result.top_logprobs.shape[-1] if result.top_logprobs is not None else 0
    for seq in sampling.seqs:
        request = seq.request
        params = request.params[seq.choice_index]
        if seq.constraint is not None or request.reasoning_budget is not None:
            return False
        if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
            return False
        if width and request.num_top_logprobs == width:
            return False
    return True


def advance(step: InFlight, scheduler: Scheduler, max_model_len: int) -> list[EngineEvent]:
    """Commit the step's positions and give each of its still-running choices a placeholder for
    the token it sampled, so the scheduler plans their next position (the module docstring)."""
    events = scheduler.commit_positions(step.plan, {})
    for index, seq in enumerate(step.sampling.seqs):
        if seq.finish is not None:
            continue
        if seq.num_output + 1 >= seq.request.max_tokens or len(seq.token_ids) + 1 >= max_model_len:
            continue  # this token is its last: nothing to plan after it
        if scheduler.memory.pages_for(len(seq.token_ids) + 1) > scheduler.pool.num_pages:
            continue  # its next position fits no pool: planning finishes it by length, after this token
        seq.token_ids.append(-1 - index)
        step.placeholders.append(seq)
    step.advanced = True
    return events


def resolve(step: InFlight) -> None:
    """Take the placeholders back out before the step's real tokens are committed in their place."""
    for seq in step.placeholders:
        assert seq.token_ids[-1] < 0, "a placeholder token is not the sequence's last"
        seq.token_ids.pop()
    step.placeholders = []
