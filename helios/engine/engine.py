"""LLMEngine: one step = abort -> schedule -> run and sample -> scheduler.update_from_output.

The engine runs the programs and the sampler; every change to a sequence or its pages is
the scheduler's (scheduler.py). build.py makes its parts; `metrics()` copies what they count.
With async output handling (overlap.py) a step's tokens are committed one step later, after the
next step has been launched.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

import torch

from helios.core import Core
from helios.core.logs import log_failure
from helios.engine import native, overlap, step_output
from helios.engine.executor import Executor, StepResult
from helios.engine.logprobs import (
    TokenLogprobs,
    explicit_alternatives,
    listed_alternatives,
    prompt_entry,
    scanned_alternatives,
)
from helios.engine.memory import embedding_rows
from helios.engine.memory.checkpoints import StepCosts
from helios.engine.memory.host_store import Histogram, HostStore
from helios.engine.memory.kv_cache import PagePool
from helios.engine.memory.state_slots import StatePool
from helios.engine.memory.window_pages import WindowPages
from helios.engine.metrics import CacheFlush, EngineMetrics, HistogramSnapshot, HostStoreMetrics
from helios.engine.parallel.world import World
from helios.engine.request import EngineEvent, EngineRequest, EngineStats, ReasoningGate
from helios.engine.sampler import Sampler, position_generator
from helios.engine.scheduler import Scheduler, constraint_error
from helios.engine.sequence import (
    Chunk,
    ModelOutput,
    SampledToken,
    SchedulerOutput,
    Sequence,
)
from helios.engine.speculation.draft_core import DraftCoreDrafter
from helios.engine.speculation.drafter import DraftRow, MaskHook, SpeculationConfig
from helios.engine.speculation.mtp import MtpDrafter

log = logging.getLogger("helios.engine")
K = TypeVar("K", int, str)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_concurrency: int = 64  # live choices at once
    max_pending: int = 256  # waiting requests before submissions are refused
    prefill_chunk_size: int = 512  # prefill tokens per step
    num_pages: int | None = None  # KV pool size in pages; None: from kv_memory_bytes
    kv_memory_bytes: int | None = 1 << 30  # used when num_pages is None; None: CPU 1 GiB, CUDA from free memory
    max_model_len: int | None = None  # None: the core's limit
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (helios.engine.devices.resolve)
    # CUDA, neither num_pages nor kv_memory_bytes: this fraction of the device memory free after the
    # weights, less the graphs' reserve, holds the KV pool (devices.kv_pages_for).
    kv_memory_fraction: float = 0.9
    # CUDA only: decode-only steps replay a graph captured per decode bucket (helios.engine.graphs).
    cuda_graphs: bool = False
    enable_prefix_cache: bool = True
    serial_decode_rows: int | None = 0  # CPU: decode-only steps of at most this many rows use one thread; None: measure
    compiled_step: bool = True  # run the core's ahead-of-time step where it was built for this host
    runtime: str = "torch"  # "onnxruntime": the step programs' ONNX renditions (onnx_runner.py)
    speculation: SpeculationConfig = SpeculationConfig(mode="off")  # drafts verified per decode round (drafter.py)
    # Hybrid cores (recurrent state): snapshot slots for prefix reuse (None: one per max_concurrency)
    # and the prompt interval they are taken at in tokens (None: the prefill chunk, whole pages; 0: only at
    # each prompt's last page boundary).
    state_snapshots: int | None = None
    snapshot_interval: int | None = None
    anchor_guards: int | None = None  # snapshot slots kept for conversation anchors (None: a quarter)
    # Hybrid cores: the predicted extra work hinted checkpoints (conversation anchor, message ends,
    # cache_control) may add to a request, as a fraction of its predicted prefill time.
    checkpoint_work_fraction: float = 0.05
    host_cache: HostCacheConfig | None = None  # the host prefix store (host_store.py); None: off
    # Cores whose sliding-window layers keep their caches in a window pool (KvLayout.window_pool): give
    # those layers a second page table and free their pages behind the window (window_pages.py).
    # False: both tables are the main pool's (the window caches as large as the others).
    reclaim_window_pages: bool = True
    # CPU, bfloat16 caches on AVX512-BF16: full pages also kept in the attention kernel's tile layout
    # (native/packed_pages.cpp), at up to twice the pool's memory, touched as pages are first read full.
    packed_kv_pages: bool = True
    image_cache_bytes: int = 256 << 20  # vision cores: prepared image features kept by digest (images.py)
    # Cores with host embedding tables (export --host-embeddings): device rows kept per table and where
    # missed rows are read, "ram" or "disk" (memory/embedding_rows.py).
    row_cache: embedding_rows.RowCacheConfig = embedding_rows.RowCacheConfig()
    # A small core with the same tokenizer that proposes drafts (draft_core.py); None: the core's own
    # MTP programs where it has them, else history drafts only.
    draft_core: Core | None = None
    # Tensor parallel: the joined ranks (helios.engine.parallel); the core is then rank 0's view of it
    # (world.rank_core) and the executor sends each call to the other ranks. None: one rank.
    parallel: World | None = None
    # Async output handling (overlap.py): plan and launch the next step before reading this one's
    # tokens. None: on for accelerator devices, off on the CPU (no gain measured there).
    async_output: bool | None = None


@dataclass(frozen=True, slots=True)
class HostCacheConfig:
    memory_bytes: int  # DRAM tier bound
    directory: Path | None  # disk tier root (a subdirectory per core identity); None: no disk tier
    disk_bytes: int  # disk tier bound
    # Bound on the bytes of pages (and state snapshots) pinned for the copier and not yet released:
    # offers beyond it are dropped while the copier is behind (it also bounds the engine's wait when
    # the pool needs pinned pages back).
    copy_queue_bytes: int = 256 << 20


class LLMEngine:
    """The parts one core runs with (built by `build_engine`), and the step over them."""

    def __init__(
        self,
        core: Core,
        config: EngineConfig,
        *,
        max_model_len: int,
        upcast_from: str | None,
        stats: EngineStats,
        pool: PagePool,
        window: WindowPages | None,
        states: StatePool | None,
        costs: StepCosts,
        executor: Executor,
        scheduler: Scheduler,
        learned: MtpDrafter | DraftCoreDrafter | None,
        sampler: Sampler,
        mask_hook: MaskHook | None,
    ) -> None:
        self.core = core
        self.config = config
        self.vocab_size = core.manifest.tokenizer.vocab_size
        self.max_model_len = max_model_len  # prompt plus output, at most the core's limit
        self.upcast_from = upcast_from  # the 16-bit weight dtype run upcast to fp32 on this CPU, or None
        self.stats = stats
        self.pool = pool  # the main KV pool (the scheduler's to change)
        self.window = window  # the sliding layers' own pool, or None
        self.states = states  # hybrid cores' recurrent-state slots, or None
        self.costs = costs  # what hinted checkpoints of hybrid cores are predicted to cost
        self.executor = executor
        self.scheduler = scheduler
        self.learned = learned  # the learned drafter (MTP programs or a draft core), or None
        self.sampler = sampler
        self.mask_hook = mask_hook
        self._aborted: set[tuple[str, int | None]] = set()
        self._prefill_ns = self._prefill_tokens = 0
        # Each budgeted choice's own reasoning gate, forked when it first reaches its cap.
        self._gates: weakref.WeakKeyDictionary[Sequence, ReasoningGate] = weakref.WeakKeyDictionary()
        # Async output handling, where no part of the engine needs each step's tokens first (overlap.py).
        self.async_output = (
            overlap.enabled(config.async_output, executor.device)
            and not scheduler.drafter.enabled
            and learned is None
            and not executor.row_caches
            and states is None
        )
        self._inflight: overlap.InFlight | None = None  # the launched step whose tokens are not read yet

    @property
    def host(self) -> HostStore | None:
        return self.scheduler.host

    def on_copied(self, callback) -> None:
        """Call `callback` (from the copier thread) when copies finish, so an idle engine loop
        steps once to release their pins."""
        if self.scheduler.copy_out.copier is not None:
            self.scheduler.copy_out.copier.on_done = callback

    def drain_copies(self) -> None:
        """Wait for the copier and release every pin (tests, shutdown; the pool is whole again)."""
        copier = self.scheduler.copy_out.copier
        if copier is not None:
            while True:  # a retried deferred offer pins more: until nothing is pinned or deferred
                self.scheduler.copy_out.hand_off_copies()
                copier.wait()
                self.scheduler.copy_out.settle_copies()
                if not self.scheduler.copy_out.host_out:
                    break
            self._refresh_gauges()

    def flush_prefix_cache(self) -> CacheFlush | None:
        """Drop every cached prefix: the pools' cached pages, state snapshots and the host store's
        records, after its copier finished (engine thread, between steps). None, dropping nothing,
        while a sequence runs, waits or awaits its abort: a flush applies to an idle engine only."""
        if self.scheduler.has_work or self._aborted or self._inflight is not None:
            return None
        self.drain_copies()
        host = self.scheduler.host
        flushed = CacheFlush(
            pages=self.pool.drop_cached(),
            window_pages=self.window.pool.drop_cached() if self.window is not None else 0,
            snapshots=self.states.drop_snapshots() if self.states is not None else 0,
            host_records=host.clear() if host is not None else 0,
        )
        self._refresh_gauges()
        return flushed

    # ------------------------------------------------------------------ metrics
    def _weights_in_memory(self) -> str:
        """The weight precision the executor holds (EngineMetrics.weights_in_memory)."""
        if self.executor.quantized is not None:
            return self.executor.quantized.in_memory
        return "float32" if self.upcast_from else self.core.manifest.weights.dtype

    def metrics(self) -> EngineMetrics:
        """One frozen copy of every value /metrics and the startup line report (read racily from the
        engine thread's counters: any thread may call it). Every EngineStats counter EngineMetrics
        names is copied under its own name (_copied); the rest come from the engine's parts."""
        drafter, copy_out = self.scheduler.drafter, self.scheduler.copy_out
        in_use, total, intake = copy_out.checkpoint_slots
        return EngineMetrics(
            device=self.executor.device,
            step_kind=self.executor.step_kind,
            cuda_graphs=self.executor.graphs is not None,
            upcast_from=self.upcast_from,
            attention_kernels=native.status(),
            max_model_len=self.max_model_len,
            learned_drafter=drafter.learned_name,
            history_drafts_enabled=drafter.enabled and drafter.config.history and drafter.config.shared_history,
            graph_launches=_counts(self.executor.launches),
            checkpoint_slots_in_use=in_use,
            checkpoint_slots_total=total,
            checkpoint_intake_slots=intake,
            host=self._host_metrics(),
            parallel_ranks=self.config.parallel.size if self.config.parallel is not None else 1,
            weights_in_memory=self._weights_in_memory(),
            **embedding_rows.metrics(self.executor.row_caches),
            **_copied(self.stats, EngineMetrics),
        )

    def _host_metrics(self) -> HostStoreMetrics | None:
        host, copy_out = self.scheduler.host, self.scheduler.copy_out
        if host is None:
            return None
        stats = host.stats
        return HostStoreMetrics(
            memory_records=host.memory_records,
            disk_records=host.disk_records,
            parked_records=host.parked_records,
            anchor_records=host.anchor_records,
            copyout_pinned_records=copy_out.pinned_records,
            copyout_deferrals=stats.copy_deferrals,
            copyout_waits=stats.copy_waits,
            copyout_wait_ns=stats.copy_wait_ns,
            copyout_worker_ns=copy_out.copier_ns,
            estimated_transfer_ns=_histogram(stats.transfer_ns),
            estimated_prefill_ns=_histogram(stats.prefill_ns),
            **_copied(stats, HostStoreMetrics),  # hits, reused_tokens, bytes_*, skipped, held, dropped, missing_tokens
        )

    def _measure(self, plan: SchedulerOutput, elapsed_ns: int) -> None:
        """The prefill and copy-in rates the host store's lookup estimates use (running means over
        steps that prefilled; a step's whole time is charged to its prompt tokens)."""
        host = self.scheduler.host
        if host is None:
            return
        prompt = sum(
            min(c.start + c.num_tokens, c.seq.num_prompt) - c.start for c in plan.chunks if c.start < c.seq.num_prompt
        )
        if prompt:
            self._prefill_ns += elapsed_ns
            self._prefill_tokens += prompt
            host.prefill_ns_per_token = self._prefill_ns / self._prefill_tokens
        if self.executor.host_in_bytes:
            host.copy_ns_per_byte = self.executor.host_in_ns / self.executor.host_in_bytes

    def prefetch(self, request: EngineRequest) -> None:
        """Hint the host store to bring this prompt's disk records into memory (off this thread)."""
        host = self.scheduler.host
        if host is not None and request.use_prefix_cache and self.config.enable_prefix_cache:
            size = self.pool.page_tokens
            host.prefetch(
                request.prompt_ids,
                lambda index: request.page_identity(index, size),
                size,
                self.states is not None,
                key=request.request_id,
            )

    def close(self) -> None:
        """Finish the host store's copies and disk writes (shutdown)."""
        if self.scheduler.host is not None:
            self.drain_copies()
            assert self.scheduler.copy_out.copier is not None
            self.scheduler.copy_out.copier.close()
            self.scheduler.host.close()

    # ------------------------------------------------------------------ requests
    def check(self, request: EngineRequest) -> str | None:
        """Why the engine can never run this request, or None."""
        limit = self.config.max_concurrency
        if not request.prompt_ids:
            return "the prompt is empty"
        if request.n > limit:
            return f"n ({request.n} choices) exceeds this server's max_concurrency of {limit}: ask for at most {limit}"
        if request.max_tokens < 1 and request.prompt_logprobs is None:
            return "max_tokens must be positive (zero only for prompt scoring)"
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_model_len:
            return f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the context limit of {self.max_model_len} tokens"
        needed = self.scheduler.min_pages(request)
        if needed > self.pool.num_pages:
            return (
                f"the prompt ({len(request.prompt_ids)} tokens) and one output token per choice need {needed} KV "
                f"pages but the pool has {self.pool.num_pages} (raise [server] kv_pages or kv_memory_mb)"
            )
        if request.prompt_logprobs is not None and self.executor.scored is None:
            return "prompt logprobs need a core exported with `ignition export --prompt-logprobs`"
        return None

    def add(self, request: EngineRequest) -> None:
        if not self.config.enable_prefix_cache and request.use_prefix_cache:
            request = replace(request, use_prefix_cache=False)
        self.scheduler.add(request)

    def abort(self, request_id: str, choice_index: int | None = None) -> None:
        """Cancel a request (every choice, or one); applied before the next step."""
        self._aborted.add((request_id, choice_index))

    @property
    def has_work(self) -> bool:
        copier = self.scheduler.copy_out.copier
        return (
            self.scheduler.has_work
            or self._inflight is not None
            or bool(self._aborted)
            or bool(self.scheduler.copy_out.copies_deferred)
            or (copier is not None and copier.has_done)
        )

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        previous, self._inflight = self._inflight, None
        if previous is not None and self._aborted:  # an abort follows every step launched before it
            events += self._complete(previous)
            previous = None
        events += self._apply_aborts()
        self.scheduler.copy_out.settle_copies()  # the step boundary: pins of finished copies are released
        if previous is not None:  # plan past its tokens, still on the device (overlap.py)
            events += overlap.advance(previous, self.scheduler, self.scheduler.config.max_model_len)
        plan = self.scheduler.schedule()
        events += plan.finished
        if not plan.chunks and self.scheduler.awaiting_prefetch and self.scheduler.host is not None:
            waited = time.perf_counter_ns()
            self.scheduler.host.wait_prefetch(0.005)  # nothing to run until the head's records are read
            self.stats.readiness_wait_ns += time.perf_counter_ns() - waited
        launched = None
        if plan.chunks:
            try:
                launched = self._launch(plan, previous)
            except Exception as exc:  # a failed step fails its own requests; the engine keeps serving
                if previous is not None:  # the step before it ran: its tokens first
                    events += self._complete(previous)
                    previous = None
                log_failure(log, "step failed", exc)
                events += self.scheduler.fail(plan, f"execution failed: {exc}")
        if previous is not None:  # its host work overlaps the device's on the step just launched
            events += self._complete(previous)
        if launched is not None:
            if self.async_output and overlap.overlaps(plan, launched.sampling, launched.result):
                self._inflight = launched
            else:
                events += self._complete(launched)
        self.scheduler.copy_out.hand_off_copies()  # what finishing sequences pinned, copied while the next step runs
        self._refresh_gauges()
        self.stats.steps += 1
        return events

    def _launch(self, plan: SchedulerOutput, previous: overlap.InFlight | None) -> overlap.InFlight:
        """Run the plan and sample on the device, starting the copy of what the host reads; the
        previous step's sampled ids feed its placeholders (overlap.py)."""
        started, restoring = time.perf_counter_ns(), self.executor.host_in_ns
        delivering = embedding_rows.delivery_ns(self.executor.row_caches)
        fed = previous.sampling.sampled if previous is not None and previous.placeholders else None
        result = self._execute(plan, fed)
        sampling = self._start_sampling(plan, result)
        restored = self.executor.host_in_ns - restoring
        delivered = embedding_rows.delivery_ns(self.executor.row_caches) - delivering  # missed host rows
        if plan.memory.host_in or plan.memory.state_in or delivered:
            self.stats.readiness_samples += 1
            self.stats.readiness_wait_ns += restored + delivered
        return overlap.InFlight(
            plan, result, sampling, started, time.perf_counter_ns() - started, restored, self.executor.take_timers()
        )

    def _complete(self, step: overlap.InFlight) -> list[EngineEvent]:
        """Read a launched step's tokens and commit them (stops, finishes, events)."""
        plan, result = step.plan, step.result
        waited = time.perf_counter_ns()
        try:
            output = self._finish_sampling(plan, result, step.sampling)  # waits for the step's copy
            # api.md replay_gpu_ns: on CUDA the programs' device time (events) plus restores; the
            # step's wall time on other devices (its launch and the wait for its values).
            device_ns = self.executor.device_time_ns(step.timers)
            host_ns = step.host_ns + time.perf_counter_ns() - waited
            self.stats.replay_ns += host_ns if device_ns is None else device_ns + step.restored_ns
            if self.states is not None:  # hybrid cores' checkpoint costs (checkpoints.StepCosts)
                self.costs.observe_step(
                    sum(c.num_tokens + len(c.draft_ids) for c in plan.chunks), time.perf_counter_ns() - step.started
                )
        except Exception as exc:  # a failed step fails its own requests; the engine keeps serving
            log_failure(log, "step failed", exc)
            return self.scheduler.fail(plan, f"execution failed: {exc}")
        overlap.resolve(step)
        tables = {id(s): list(s.pages) for s in plan.sequences} if self.learned is not None else {}
        generated = self.stats.generated_tokens
        if step.advanced:
            events = self.scheduler.commit_tokens(plan, output)
        else:
            events = self.scheduler.update_from_output(plan, output)
        self._observe_payoff(plan, self.stats.generated_tokens - generated, time.perf_counter_ns() - step.started)
        if self.learned is not None:
            self._propose(plan, result, tables)
        return events

    def _observe_payoff(self, plan: SchedulerOutput, committed: int, elapsed_ns: int) -> None:
        """Adaptive speculation's gate learns from decode-only steps (drafter.PayoffGate)."""
        if self.scheduler.drafter.config.mode != "adaptive":
            return
        if any(c.num_tokens != 1 or c.scored for c in plan.chunks):
            return  # a prefill chunk's cost says nothing about drafts
        drafted = any(c.draft_ids for c in plan.chunks)
        self.scheduler.drafter.gate.observe(len(plan.chunks), drafted, committed, elapsed_ns / 1e9)

    def _apply_aborts(self) -> list[EngineEvent]:
        if not self._aborted:
            return []
        doomed, self._aborted = self._aborted, set()
        return self.scheduler.abort(doomed)

    def _propose(self, plan: SchedulerOutput, result: StepResult, tables: dict[int, list[int]]) -> None:
        """The learned drafter's turn after a committed step (a failure there costs drafts only)."""
        assert self.learned is not None
        try:
            self.learned.observe(plan, result.hidden, tables, self.scheduler.learned_depths())
        except Exception as exc:
            log_failure(log, "learned drafter failed; this round has no learned drafts", exc)

    def _run(self, plan: SchedulerOutput) -> ModelOutput:
        """Run the programs, then sample every choice of every sampled chunk and verify drafts."""
        return self._sample_step(plan, self._execute(plan))

    def _execute(self, plan: SchedulerOutput, fed: torch.Tensor | None = None) -> StepResult:
        started = time.perf_counter_ns()
        if fed is None:
            result = self.executor.run(plan.chunks, plan.memory)
        else:  # the previous step's sampled ids feed the placeholders of its choices (overlap.py)
            result = self.executor.run(plan.chunks, plan.memory, fed=fed)
        self._measure(plan, time.perf_counter_ns() - started)
        return result

    def _sample_step(self, plan: SchedulerOutput, result: StepResult) -> ModelOutput:
        """Sample every choice of every sampled chunk and verify drafts. Sampling runs on the
        outputs' device; what the host reads comes back in one copy (step_output.fetch)."""
        return self._finish_sampling(plan, result, self._start_sampling(plan, result))

    def _start_sampling(self, plan: SchedulerOutput, result: StepResult) -> overlap.Sampling:
        """Draw every sampling row on the outputs' device and start the step's one copy to the host."""
        self._count_verify_step(plan)
        # One sampling row per choice, and for a chunk with drafts one per position: row i
        # samples the token after draft i - 1, as if drafts[:i] had been committed.
        rows: list[int] = []
        seqs: list[Sequence] = []
        prefixes: list[tuple[int, ...]] = []
        masked: list[object] = []  # what the mask hook reads per row: the sequence, or its constraint after drafts
        drafts: dict[int, tuple[int, ...]] = {}
        cursor = 0
        for chunk in result.sampled:
            if chunk.seq.request.max_tokens > 0:
                if chunk.draft_ids:
                    drafts[id(chunk.seq)] = chunk.draft_ids
                    rows += range(cursor, cursor + chunk.num_rows)
                    seqs += [chunk.seq] * chunk.num_rows
                    prefixes += [chunk.draft_ids[:i] for i in range(chunk.num_rows)]
                    states = chunk.draft_states or (None,) * chunk.num_rows
                    masked += [chunk.seq] + [DraftRow(chunk.seq.request, state) for state in states[1:]]
                else:
                    rows += [cursor] * len(chunk.choices)
                    seqs += chunk.choices
                    prefixes += [()] * len(chunk.choices)
                    masked += chunk.choices
            cursor += chunk.num_rows
        allowed = self.mask_hook(masked) if self.mask_hook and seqs else None
        blocked: set[int] = set()
        if allowed is not None:
            blocked = set((~allowed.any(dim=-1)).nonzero().flatten().tolist())
            if blocked:  # sampled harmlessly; such a row fails its choice only if verification reaches it
                allowed[list(blocked)] = True
        sampled = None
        if seqs:
            logits = result.logits
            if rows != list(range(logits.shape[0])):
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            sampled = self._sample(logits, seqs, prefixes, allowed)  # on the outputs' device
        fetch = step_output.fetch_start(result, rows, sampled, [s.request.num_top_logprobs for s in seqs])
        return overlap.Sampling(rows, seqs, prefixes, masked, drafts, allowed, blocked, sampled, fetch)

    def _finish_sampling(self, plan: SchedulerOutput, result: StepResult, sampling: overlap.Sampling) -> ModelOutput:
        """The step's tokens from its copy to the host: blocked rows, forced closes, logprob entries,
        and where each choice's round ended (a draft rejected)."""
        rows, seqs, prefixes, masked = sampling.rows, sampling.seqs, sampling.prefixes, sampling.masked
        drafts, allowed, blocked = sampling.drafts, sampling.allowed, sampling.blocked
        errors: dict[int, str] = {}
        tokens: dict[int, list[SampledToken]] = {}
        host = sampling.fetch.wait()
        prompt_entries = {
            key: self._prompt_entries(chunk, host.prompt_scores[key])
            for chunk in plan.chunks
            if (key := id(chunk)) in host.prompt_scores
        }
        if seqs:
            drawn = host.tokens
            settled: set[int] = set()  # sequences whose round ended (a draft was rejected)
            for index, (row, seq, prefix, token) in enumerate(zip(rows, seqs, prefixes, drawn)):
                key = id(seq)
                if key in settled:
                    continue
                if index in blocked:
                    errors[key] = constraint_error(masked[index])
                    tokens.pop(key, None)
                    settled.add(key)
                    continue
                forced = (
                    self._budget_close(seq, allowed[index] if allowed is not None else None) if not prefix else None
                )
                if forced is not None:
                    tokens[key] = [SampledToken(forced, None, forced=True)]  # forced tokens have no entry
                    settled.add(key)
                    continue
                wants = seq.request.num_top_logprobs is not None
                entry = self._logprobs(seq, token, host.logprobs[index], result, row) if wants else None
                tokens.setdefault(key, []).append(SampledToken(token, entry))
                offered = drafts.get(key, ())
                if len(prefix) >= len(offered) or token != offered[len(prefix)]:
                    settled.add(key)  # a correction, or the bonus token after every draft was accepted
        return ModelOutput({key: tuple(values) for key, values in tokens.items()}, errors, prompt_entries)

    def _count_verify_step(self, plan: SchedulerOutput) -> None:
        decoding = [c for c in plan.chunks if c.wants_logits and c.num_tokens == 1 and c.seq.num_output > 0]
        if decoding:
            self.stats.count_verify_step(len(decoding), max(1 + len(c.draft_ids) for c in decoding))

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], prefixes: list[tuple[int, ...]], allowed: torch.Tensor | None
    ) -> torch.Tensor:
        params = [s.request.params[s.choice_index] for s in seqs]
        # Only penalized rows' ids: another row's count is never read, and its last token may still
        # be a placeholder on the device (overlap.py).
        penalized = [p.repetition_penalty != 1 or bool(p.presence_penalty or p.frequency_penalty) for p in params]
        empty = torch.empty(0, dtype=torch.int64)
        prompt_ids = [torch.tensor(s.token_ids[: s.num_prompt]) if pen else empty for s, pen in zip(seqs, penalized)]
        output_ids = [
            torch.tensor(s.output_ids + list(prefix), dtype=torch.int64) if pen else empty
            for s, prefix, pen in zip(seqs, prefixes, penalized)
        ]
        # A draw depends on the choice's seed and the output position it fills, so verification
        # rows draw exactly what plain decoding would have drawn at those positions.
        generators = [
            position_generator(p.seed, s.num_output + len(prefix), logits.device) if p.top_k != 1 else None
            for p, s, prefix in zip(params, seqs, prefixes)
        ]
        return self.sampler.sample(logits, params, generators, prompt_ids, output_ids, allowed)

    @staticmethod
    def _logprobs(
        seq: Sequence, token: int, values: step_output.RowLogprobs, result: StepResult, row: int
    ) -> TokenLogprobs:
        """A sampled token's entry from its row's host values (row: its output row, read again
        only where natural alternatives tie across their cut-off)."""
        lse = values.logsumexp
        chosen = values.chosen_logit - lse
        ids = seq.request.logprob_token_ids
        num = seq.request.num_top_logprobs
        if ids:
            assert values.explicit is not None
            alternatives = explicit_alternatives(ids, values.explicit[: len(ids)], token, chosen)
        elif values.top_values is not None and values.top_ids is not None and num:
            listed = listed_alternatives(values.top_values, values.top_ids, num, values.at_cutoff)
            alternatives = (
                listed
                if listed is not None
                else scanned_alternatives(step_output.logits_row(result, row), lse, values.top_values[num - 1], num)
            )
        else:
            alternatives = ()
        return TokenLogprobs(token, chosen, alternatives)

    @staticmethod
    def _prompt_entries(chunk: Chunk, scores: dict[str, list]) -> list:
        """Prompt logprob entries of a scored chunk's positions (the first prompt position and image
        positions have none: an image row's token is a placeholder, not a prediction target), from
        the scores' host values (step_output.fetch)."""
        seq = chunk.seq
        num = seq.request.prompt_logprobs or 0
        entries: list = [None] if chunk.start == 0 else []
        values = scores["prompt_logprobs"]
        ranks = scores["prompt_ranks"]
        images = seq.request.images
        for i in range(chunk.num_tokens):
            position = chunk.start + i + 1
            if position >= seq.num_prompt:
                break
            if images and any(image.covers(position) for image in images):
                entries.append(None)
                continue
            alternatives = ()
            if num:
                # Every entry the program returned, then the first `num`: torch.topk keeps an
                # unspecified member of a tie at the cut-off, and ties report increasing ids.
                pairs = zip(scores["prompt_top_ids"][i], scores["prompt_top_logprobs"][i])
                alternatives = tuple(sorted(pairs, key=lambda p: (-p[1], p[0]))[:num])
            entries.append(prompt_entry(seq.token_ids[position], values[i], ranks[i], alternatives))
        return entries

    def _budget_close(self, seq: Sequence, allowed: torch.Tensor | None) -> int | None:
        """The close delimiter, when this sequence's reasoning budget is spent, output remains, the
        row's grammar mask (`allowed`, [V]) admits it and no tool opener in reasoning is undecided."""
        budget = seq.request.reasoning_budget
        if budget is None or not seq.reasoning_open or seq.reasoning_tokens < budget.budget:
            return None
        if seq.num_output + 1 >= seq.request.max_tokens:
            return None  # no capacity left to continue after the close
        if allowed is not None and not bool(allowed[budget.close_id]):
            return None  # the output grammar disallows the close here
        if budget.gate is not None:
            gate = self._gates.get(seq)
            if gate is None:
                gate = self._gates[seq] = budget.gate.fork()
            if not gate.allows_close(seq.token_ids, seq.num_prompt):
                return None  # a tool opener waits for its decision, or a call ended reasoning
        return budget.close_id

    def _refresh_gauges(self) -> None:
        self.stats.active = len(self.scheduler.running)
        self.stats.pending = len(self.scheduler.waiting)
        self.stats.free_pages = self.pool.num_free
        self.stats.cached_pages = self.pool.num_cached
        if self.states is not None:
            self.stats.state_slots_used = self.states.live_in_use
            self.stats.state_snapshots = self.states.snapshots_held
            self.stats.checkpoint_anchor_reservations = self.states.unused_guards


def _counts(table: Mapping[K, int]) -> tuple[tuple[K, int], ...]:
    """A counter table's (key, count) pairs, sorted (a copy: the engine thread keeps counting)."""
    return tuple(sorted(dict(table).items()))


def _copied(counters: object, into: type) -> dict[str, object]:
    """The dataclass `counters`' fields that `into` has under the same name, copied (_copy)."""
    names = {f.name for f in fields(into)}
    return {f.name: _copy(getattr(counters, f.name)) for f in fields(counters) if f.name in names}


def _copy(value: object) -> object:
    """A counter as a snapshot: a count as it is, a count table as its sorted (key, count) pairs (a
    compound key as "a/b"), a histogram as its buckets and sum."""
    if isinstance(value, Histogram):
        return _histogram(value)
    if isinstance(value, dict):
        return _counts({"/".join(key) if isinstance(key, tuple) else key: n for key, n in dict(value).items()})
    return value


def _histogram(histogram: Histogram) -> HistogramSnapshot:
    return HistogramSnapshot(tuple(histogram.cumulative()), histogram.sum)
