"""LLMEngine: one step = abort -> schedule -> run and sample -> scheduler.update_from_output.

The engine runs the programs and the sampler; every change to a sequence or its pages is
the scheduler's (scheduler.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from helios.core import Core
from helios.core.logs import log_failure
from helios.engine import devices, precision
from helios.engine.checkpoints import StepCosts
from helios.engine.draft_core import DraftCoreDrafter
from helios.engine.drafter import DraftPicker, DraftRow, MaskHook, SpeculationConfig
from helios.engine.executor import Executor, StepResult
from helios.engine.kv_cache import PagePool
from helios.engine.logprobs import (
    TokenLogprobs,
    explicit_alternatives,
    natural_alternatives,
    prompt_entry,
)
from helios.engine.request import EngineEvent, EngineRequest, EngineStats
from helios.engine.mtp import MTP_CACHE, MtpDrafter, mtp_kinds
from helios.engine.sampler import Sampler, position_generator
from helios.engine.scheduler import Scheduler, SchedulerConfig, constraint_error
from helios.engine.host_copy import Copier
from helios.engine.host_store import HostStore, identity_of
from helios.engine.state_slots import StatePool
from helios.engine.window_pages import WindowPages, min_pool_pages, pool_pages
from helios.engine.sequence import (
    Chunk,
    ModelOutput,
    SampledToken,
    SchedulerOutput,
    Sequence,
)

log = logging.getLogger("helios.engine")

# Hybrid cores with speculation: spare live state slots, each lent to one drafting sequence for a
# step (its state before verification). Speculation pays at low concurrency, where few sequences
# draft at once; a sequence finding none free decodes without drafts that step.
ROLLBACK_SLOTS = 8


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
    image_cache_bytes: int = 256 << 20  # vision cores: prepared image features kept by digest (images.py)
    # A small core with the same tokenizer that proposes drafts (draft_core.py); None: the core's own
    # MTP programs where it has them, else history drafts only.
    draft_core: Core | None = None


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
    def __init__(self, core: Core, config: EngineConfig, mask_hook: MaskHook | None = None) -> None:
        m = core.manifest
        self.core = core
        self.config = config
        self.vocab_size = m.tokenizer.vocab_size
        self.max_model_len = min(config.max_model_len or m.limits.max_model_len, m.limits.max_model_len)
        # A 16-bit core on a CPU without native 16-bit matmuls runs upcast to fp32 (measured).
        self.upcast_from = (
            m.weights.dtype
            if config.device == "cpu"
            and m.weights.dtype in ("bfloat16", "float16")
            and not precision.is_native(getattr(torch, m.weights.dtype))
            else None
        )
        kv_dtype = "float32" if self.upcast_from else m.kv.dtype
        element = torch.tensor([], dtype=getattr(torch, kv_dtype)).element_size()
        page, main_bytes = m.limits.page_tokens, m.kv.token_elements * m.limits.page_tokens * element
        window_page_bytes = m.kv.window_token_elements * page * element  # 0 without window caches
        # One pool for every cache tensor: what the budget holds (the window caches, if any, as large).
        num_pages = config.num_pages or self._pool_pages(core, config, main_bytes + window_page_bytes)
        pooled = m.kv.window_pool if config.reclaim_window_pages else None
        num_window_pages = None
        if pooled is not None:
            # As many window pages as that one pool (equal token capacity), at most what running
            # sequences can hold at once, at least what one needs; the bytes saved go to the main pool.
            drafts = config.speculation.max_drafts if config.speculation.mode != "off" else 0
            most = pool_pages(pooled.window, page, config.max_concurrency, config.prefill_chunk_size, drafts)
            num_window_pages = max(min_pool_pages(pooled.window, page, config.prefill_chunk_size), min(most, num_pages))
            if main_bytes:  # (a core whose every layer slides keeps page ids only in the main pool)
                num_pages = max(1, num_pages + (num_pages - num_window_pages) * window_page_bytes // main_bytes)
        self.pool = PagePool(num_pages, m.limits.page_tokens)
        self.window = None
        if pooled is not None and num_window_pages is not None:
            self.window = WindowPages(PagePool(num_window_pages, page), pooled.window)
            log.info(
                "window pool: the sliding layers' caches hold %d pages (%d MiB), freed %d tokens behind each "
                "query; the other layers' pool %d pages",
                num_window_pages,
                num_window_pages * window_page_bytes >> 20,
                pooled.window,
                num_pages,
            )
        self.stats = EngineStats(
            total_pages=num_pages, page_tokens=m.limits.page_tokens, decode_weight_bytes=m.decode_weight_bytes
        )
        self.states = None
        if m.kv.state:
            snapshots = config.max_concurrency if config.state_snapshots is None else config.state_snapshots
            # Speculation lends spare live slots for rollback copies (scheduler: drafting hybrids).
            spare = min(config.max_concurrency, ROLLBACK_SLOTS) if config.speculation.mode != "off" else 0
            self.states = StatePool(config.max_concurrency, snapshots, config.anchor_guards, spare)
            self.stats.state_slots = self.states.num_slots
            self.stats.state_slot_bytes = m.kv.slot_bytes
        page = m.limits.page_tokens
        interval = config.snapshot_interval
        if interval is None:
            interval = max(page, config.prefill_chunk_size // page * page)
        speculation = config.speculation
        learned = speculation.mode != "off" and speculation.learned
        drafters = mtp_kinds(m.programs) if learned and config.draft_core is None else ()
        self.executor = Executor(
            core,
            num_pages,
            config.device,
            config.serial_decode_rows,
            self.upcast_from is not None,
            config.compiled_step,
            self.states.num_slots if self.states else 1,
            drafters,
            cuda_graphs=config.cuda_graphs and devices.is_cuda(config.device),
            num_window_pages=num_window_pages,
        )
        if self.executor.vision is not None and m.vision is not None:
            from helios.engine.images import ImageEncoder

            weights = self.executor.weights or core.load_weights(config.device)  # a compiled step keeps none
            self.executor.images = ImageEncoder(
                self.executor.vision,
                weights,
                m.vision.feature_dim,
                m.vision.image_feature_window_tokens * config.max_concurrency,
                config.device,
                self.stats,
                config.image_cache_bytes,
            )
        self.costs = StepCosts()  # what hinted checkpoints of hybrid cores are predicted to cost
        if self.states is not None:
            self._measure_state_copy()
        if speculation.mode == "adaptive" and speculation.row_budget is None:  # only adaptive mode keeps a budget
            speculation = replace(speculation, row_budget=self.executor.speculation_rows(core))
        host = self._host_store(core, config, kv_dtype)
        copier = Copier(host, self.executor.page_caches, self.executor.state) if host is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_concurrency,
                config.prefill_chunk_size,
                self.max_model_len,
                frozenset(m.tokenizer.eos_token_ids),
                -(-interval // page) * page,
                config.checkpoint_work_fraction,
                "attention_until" in self.executor.step.input_names,
            ),
            self.pool,
            self.stats,
            speculation,
            self.states,
            host,
            self.executor.page_bytes,
            self.costs,
            copier,
            config.host_cache.copy_queue_bytes if config.host_cache is not None else 0,
            self.window,
        )
        if self.executor.compiled_fallback:
            log.warning("%s", self.executor.compiled_fallback)
        self.learned: MtpDrafter | DraftCoreDrafter | None = None
        if drafters:
            self.learned = self._mtp_drafter(core, drafters, speculation)
        elif learned and config.draft_core is not None:
            self.learned = DraftCoreDrafter(
                config.draft_core,
                m,
                num_pages,
                config.device,
                speculation.max_drafts,
                config.max_concurrency,
                config.prefill_chunk_size,
                self.stats,
            )
        self.scheduler.drafter.learned = self.learned
        if self.learned is not None:  # learned drafts follow the grammar of a constrained sequence
            self.learned.picker = DraftPicker(mask_hook)
        self.sampler = Sampler()
        self.mask_hook = mask_hook
        self._aborted: set[tuple[str, int | None]] = set()
        self._prefill_ns = self._prefill_tokens = 0
        self._refresh_gauges()
        if self.executor.graphs is not None:  # after the drafters widened the caches the graphs read
            self.executor.capture_graphs()

    def _mtp_drafter(self, core: Core, kinds: tuple[str, ...], speculation: SpeculationConfig) -> MtpDrafter:
        """The core's MTP programs as the learned drafter, its caches widened by scratch pages
        (enough for every live sequence's speculative rows past its own pages)."""
        kv = core.manifest.kv
        first = kv.num_caches - sum(len(e.layers) for e in kv.extra)
        indexes, index = [], first
        for extra in kv.extra:
            if extra.name == MTP_CACHE:
                indexes += range(index, index + len(extra.layers))
            index += len(extra.layers)
        page = self.pool.page_tokens
        log.info("speculation: drafting with the core's %d MTP layer(s) (%s)", len(kinds), ", ".join(kinds))
        return MtpDrafter(
            self.executor,
            kinds,
            tuple(indexes),
            page,
            speculation.max_drafts // page + 2,
            self.config.max_concurrency,
            self.stats,
        )

    def _host_store(self, core: Core, config: EngineConfig, kv_dtype: str) -> HostStore | None:
        host = config.host_cache
        if host is None:
            return None
        m = core.manifest
        if self.window is not None:
            log.warning(
                "host cache: off for this core: its sliding layers' pages are reclaimed behind the window "
                "(reclaim_window_pages), which the host store's records do not cover yet"
            )
            return None
        shapes = m.kv.cache_shapes() if not m.kv.state else (m.kv.cache_shapes(), m.kv.state_shapes())
        identity = identity_of(core.digest, kv_dtype, m.limits.page_tokens, shapes)
        store = HostStore(identity, host.memory_bytes, host.directory, host.disk_bytes)
        # The copy-in rate for the store's lookup estimates: a few pages read and written back in place.
        pages = list(range(min(8, self.pool.num_pages)))
        started = time.perf_counter_ns()
        self.executor.write_pages(tuple(zip(pages, self.executor.read_pages(pages))))
        store.copy_ns_per_byte = (time.perf_counter_ns() - started) / (len(pages) * self.executor.page_bytes)
        log.info(
            "host prefix store: %d MiB in memory, %s",
            host.memory_bytes >> 20,
            f"{host.disk_bytes >> 20} MiB on disk in {store.directory}" if store.disk_bytes else "no disk tier",
        )
        return store

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

    def _measure_state_copy(self) -> None:
        """The state-copy rate hinted checkpoints are charged at: a few slot copies onto themselves."""
        copies = 4
        started = time.perf_counter_ns()
        for _ in range(copies):
            self.executor.copy_state(0, 0)
        if self.config.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.costs.observe_copy(copies * self.stats.state_slot_bytes, time.perf_counter_ns() - started)

    @staticmethod
    def _pool_pages(core: Core, config: EngineConfig, page_bytes: int) -> int:
        """KV pages of a pool given by bytes; on CUDA without a size, from the device's free memory
        less the weights still to load and the graphs' reserve (devices.kv_pages_for)."""
        if config.kv_memory_bytes is not None or not devices.is_cuda(config.device):
            return max(1, (1 << 30 if config.kv_memory_bytes is None else config.kv_memory_bytes) // page_bytes)
        weights = (core.root / core.manifest.weights.file).stat().st_size
        reserve = devices.GRAPH_RESERVE_PER_BUCKET * len(core.manifest.decode_buckets) if config.cuda_graphs else 0
        free = devices.free_device_bytes(config.device)
        pages = devices.kv_pages_for(max(0, free - weights), config.kv_memory_fraction, page_bytes, reserve)
        log.info(
            "KV pool: %d pages from %d MiB free on %s (%d MiB of weights to load, %d MiB kept for CUDA graphs)",
            pages,
            free >> 20,
            config.device,
            weights >> 20,
            reserve >> 20,
        )
        return pages

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
            or bool(self._aborted)
            or bool(self.scheduler.copy_out.copies_deferred)
            or (copier is not None and copier.has_done)
        )

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineEvent]:
        events = self._apply_aborts()
        self.scheduler.copy_out.settle_copies()  # the step boundary: pins of finished copies are released
        plan = self.scheduler.schedule()
        events += plan.finished
        if not plan.chunks and self.scheduler.awaiting_prefetch and self.scheduler.host is not None:
            self.scheduler.host.wait_prefetch(0.005)  # nothing to run until the head's records are read
        if plan.chunks:
            try:
                started = time.perf_counter_ns()
                result = self._execute(plan)
                output = self._sample_step(plan, result)  # sampling waits for the device, so this times the whole step
                if self.states is not None:  # hybrid cores' checkpoint costs (checkpoints.StepCosts)
                    self.costs.observe_step(
                        sum(c.num_tokens + len(c.draft_ids) for c in plan.chunks), time.perf_counter_ns() - started
                    )
            except Exception as exc:  # a failed step fails its own requests; the engine keeps serving
                log_failure(log, "step failed", exc)
                events += self.scheduler.fail(plan, f"execution failed: {exc}")
            else:
                tables = {id(s): list(s.pages) for s in plan.sequences} if self.learned is not None else {}
                generated = self.stats.generated_tokens
                events += self.scheduler.update_from_output(plan, output)
                self._observe_payoff(plan, self.stats.generated_tokens - generated, time.perf_counter_ns() - started)
                if self.learned is not None:
                    self._propose(plan, result, tables)
        self.scheduler.copy_out.hand_off_copies()  # what finishing sequences pinned, copied while the next step runs
        self._refresh_gauges()
        self.stats.steps += 1
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

    def _execute(self, plan: SchedulerOutput) -> StepResult:
        started = time.perf_counter_ns()
        result = self.executor.run(
            plan.chunks,
            plan.page_copies,
            plan.state_before,
            plan.state_after,
            plan.host_in,
            plan.state_in,
            plan.window_copies,
        )
        self._measure(plan, time.perf_counter_ns() - started)
        return result

    def _sample_step(self, plan: SchedulerOutput, result: StepResult) -> ModelOutput:
        """Sample every choice of every sampled chunk and verify drafts."""
        self._count_verify_step(plan)
        prompt_entries = {
            key: self._prompt_entries(chunk, result.prompt_scores[key])
            for chunk in plan.chunks
            if (key := id(chunk)) in result.prompt_scores
        }
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
        errors: dict[int, str] = {}
        allowed = self.mask_hook(masked) if self.mask_hook and seqs else None
        blocked: set[int] = set()
        if allowed is not None:
            blocked = set((~allowed.any(dim=-1)).nonzero().flatten().tolist())
            if blocked:  # sampled harmlessly; such a row fails its choice only if verification reaches it
                allowed[list(blocked)] = True
        tokens: dict[int, list[SampledToken]] = {}
        if seqs:
            identity = rows == list(range(result.logits.shape[0]))
            logits = result.logits if identity else result.logits.index_select(0, torch.tensor(rows))
            drawn = self._sample(logits, seqs, prefixes, allowed).tolist()
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
                forced = _budget_close(seq) if not prefix else None
                if forced is not None:
                    tokens[key] = [SampledToken(forced, None, forced=True)]  # forced tokens have no entry
                    settled.add(key)
                    continue
                wants = seq.request.num_top_logprobs is not None
                tokens.setdefault(key, []).append(
                    SampledToken(token, self._logprobs(seq, token, row, result) if wants else None)
                )
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
        penalized = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        empty = torch.empty(0, dtype=torch.int64)
        prompt_ids = [torch.tensor(s.token_ids[: s.num_prompt]) if penalized else empty for s in seqs]
        output_ids = [
            torch.tensor(s.output_ids + list(prefix), dtype=torch.int64) if penalized else empty
            for s, prefix in zip(seqs, prefixes)
        ]
        if allowed is not None:
            allowed = allowed.to(logits.device, non_blocking=True)
        # A draw depends on the choice's seed and the output position it fills, so verification
        # rows draw exactly what plain decoding would have drawn at those positions.
        generators = [
            position_generator(p.seed, s.num_output + len(prefix), logits.device) if p.top_k != 1 else None
            for p, s, prefix in zip(params, seqs, prefixes)
        ]
        return self.sampler.sample(logits, params, generators, prompt_ids, output_ids, allowed)

    def _logprobs(self, seq: Sequence, token: int, row: int, result: StepResult) -> TokenLogprobs:
        lse = float(result.logsumexp[row])
        chosen = float(result.logits[row, token]) - lse
        ids = seq.request.logprob_token_ids
        if ids:
            assert result.explicit_logprobs is not None
            values = result.explicit_logprobs[row, : len(ids)].tolist()
            alternatives = explicit_alternatives(ids, values, token, chosen)
        elif result.top_logprobs is not None and seq.request.num_top_logprobs:
            alternatives = natural_alternatives(
                result.logits[row], lse, result.top_logprobs[row], result.top_ids[row], seq.request.num_top_logprobs
            )
        else:
            alternatives = ()
        return TokenLogprobs(token, chosen, alternatives)

    @staticmethod
    def _prompt_entries(chunk: Chunk, scores: dict[str, torch.Tensor]) -> list:
        """Prompt logprob entries of a scored chunk's positions (the first prompt position and image
        positions have none: an image row's token is a placeholder, not a prediction target)."""
        seq = chunk.seq
        num = seq.request.prompt_logprobs or 0
        entries: list = [None] if chunk.start == 0 else []
        values = scores["prompt_logprobs"].tolist()
        ranks = scores["prompt_ranks"].tolist()
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
                pairs = zip(scores["prompt_top_ids"][i, :num].tolist(), scores["prompt_top_logprobs"][i, :num].tolist())
                alternatives = tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))
            entries.append(prompt_entry(seq.token_ids[position], values[i], ranks[i], alternatives))
        return entries

    def _refresh_gauges(self) -> None:
        self.stats.active = len(self.scheduler.running)
        self.stats.pending = len(self.scheduler.waiting)
        self.stats.free_pages = self.pool.num_free
        self.stats.cached_pages = self.pool.num_cached
        if self.states is not None:
            self.stats.state_slots_used = self.states.live_in_use
            self.stats.state_snapshots = self.states.snapshots_held
            self.stats.checkpoint_anchor_reservations = self.states.unused_guards


def _budget_close(seq: Sequence) -> int | None:
    """The close delimiter, when this sequence's reasoning budget is spent and output remains."""
    budget = seq.request.reasoning_budget
    if budget is None or not seq.reasoning_open or seq.reasoning_tokens < budget.budget:
        return None
    if seq.num_output + 1 >= seq.request.max_tokens:
        return None  # no capacity left to continue after the close
    return budget.close_id
