"""The engine's metrics snapshot: one frozen copy of every counter, gauge and histogram the server
exposes (/metrics, JSON and Prometheus) and of what the startup line reports.

`LLMEngine.metrics()` builds it from the scheduler, executor, drafter and host store; nothing
outside the engine reads those parts. Values are read racily from the engine thread's counters:
each is a consistent number, the set is not one instant.
"""

from __future__ import annotations

from dataclasses import dataclass

Counts = tuple[tuple[str, int], ...]  # (label value, count) pairs, sorted by label value


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A Prometheus histogram's state."""

    buckets: tuple[tuple[str, int], ...]  # (le label, cumulative count) ascending, the last "+Inf"
    sum: float  # sum of the observed values

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


EMPTY_HISTOGRAM = HistogramSnapshot((("+Inf", 0),), 0.0)


@dataclass(frozen=True, slots=True)
class CacheFlush:
    """What one prefix-cache flush dropped (LLMEngine.flush_prefix_cache, POST /flush_cache)."""

    pages: int  # cached pages of the main KV pool, now free
    window_pages: int  # cached pages of the sliding-window pool (0 without one)
    snapshots: int  # recurrent-state snapshots of hybrid cores (0 for other cores)
    host_records: int  # host prefix-store records, DRAM and disk (0 without the store)


@dataclass(frozen=True, slots=True)
class HostStoreMetrics:
    """The host prefix store (host_store.py) and its copy-out, when the engine has one."""

    hits: int  # admissions that restored at least one page from the store
    reused_tokens: int  # tokens those restores covered
    memory_records: int  # records in host memory
    disk_records: int  # records on disk
    parked_records: int  # complete DRAM copies awaiting disk writes
    anchor_records: int  # host-memory records of conversation anchors' chains
    bytes_out: int  # device -> host store
    bytes_in: int  # host store -> device
    skipped: int  # offers of records already held or being copied
    held: Counts  # records taken in, by tier ("dram", "nvme")
    dropped: Counts  # records dropped, by "tier/reason"
    copyout_pinned_records: int  # pages and snapshots pinned for the copier, not yet released
    copyout_deferrals: int  # offers deferred by the pool headroom check
    copyout_waits: int  # times the engine thread waited for the copier
    copyout_wait_ns: int  # engine-thread nanoseconds in those waits
    copyout_worker_ns: int  # copier-thread nanoseconds copying into records
    missing_tokens: HistogramSnapshot  # per lookup: prompt tokens left to compute
    estimated_transfer_ns: HistogramSnapshot  # per lookup: estimated copy-in time of what it restored
    estimated_prefill_ns: HistogramSnapshot  # per lookup: estimated prefill time it replaced


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Everything the engine reports, copied at one call (EngineClient.metrics / LLMEngine.metrics)."""

    # What runs (constant for the engine's life; the startup line and /v1/models report it).
    device: str  # "cpu", "cuda" or "cuda:N"
    step_kind: str  # which step program runs (executor.step_kind)
    cuda_graphs: bool  # decode steps replay captured CUDA graphs
    upcast_from: str | None  # a 16-bit weight dtype this CPU runs upcast to float32; None: run as stored
    attention_kernels: str  # "native", or "python (why not)"
    max_model_len: int  # prompt plus output tokens, at most the core's limit
    # Tokens and requests (counters).
    prefill_tokens: int
    generated_tokens: int
    # Choices (sequences) the engine finished by a stop or the length limit, and with an error; aborted
    # ones neither. Not api.md's completed and failed, which count requests by the outcome their
    # client sees (helios/server/outcomes.py).
    completed: int
    failed: int
    reused_tokens: int  # prompt tokens reused from the device prefix cache, counted at each request's first admission
    reasoning_budget_cuts: int
    preemptions: int
    # Scheduler gauges.
    active: int  # running sequences
    pending: int  # waiting requests
    # KV pool: free + cached + used = total.
    total_pages: int
    free_pages: int
    cached_pages: int
    page_tokens: int
    decode_weight_bytes: int
    # Speculation (counters) and its drafters.
    verify_steps: int
    verification_rounds: int
    verification_drafts: int
    accepted_drafts: int
    draft_rounds: int
    draft_steps: int
    learned_offered: int
    learned_accepted: int
    rounds_by_depth: tuple[tuple[int, int], ...]  # (drafts offered, request rounds), ascending
    steps_by_batch: tuple[tuple[int, int], ...]  # (decode rows in a verification step, steps), ascending
    steps_by_width: tuple[tuple[int, int], ...]  # (1 + most drafts of a row group, steps), ascending
    learned_drafter: str | None  # "mtp", a draft core's model id, or None
    history_drafts_enabled: bool  # shared decoded history augments learned proposals
    graph_launches: Counts  # step program calls by kind ("graph", "eager")
    # Hybrid cores' recurrent state (0 for other cores) and checkpoints.
    state_slots: int
    state_slot_bytes: int
    state_slots_used: int
    state_snapshots: int
    state_rewinds: int
    replay_ns: int  # completed steps: CPU wall time of run and sampling; CUDA events around the programs; restores included (api.md replay_gpu_ns)
    readiness_wait_ns: int  # waits for host-store data: restore copies and disk prefetch
    readiness_samples: int  # steps that carried host-store restores
    checkpoint_anchor_reservations: int
    checkpoint_captures: Counts  # by role
    checkpoint_skips: Counts  # by reason
    checkpoint_extra_work_ns: int
    # The local checkpoint pool (KV pages plus state slots): in use, total, copy-out intake.
    checkpoint_slots_in_use: int
    checkpoint_slots_total: int
    checkpoint_intake_slots: int
    images: Counts  # image preparation and feature counters, by IMAGE_COUNTERS name (the engine's share)
    host: HostStoreMetrics | None  # None without a host prefix store
    parallel_ranks: int = 1  # tensor-parallel ranks; total_pages and the page gauges are per rank (each holds as many)
    # The device row cache of host embedding tables (memory/embedding_rows.py), summed over a core's tables;
    # all 0 on a core without host tables (exported without --host-embeddings).
    embedding_row_lookups: int = 0  # distinct table rows asked for, one per distinct row per program run
    embedding_row_hits: int = 0  # of those, found on the device
    embedding_row_misses: int = 0  # of those, read from the host table (RAM or disk)
    embedding_row_evictions: int = 0  # resident rows dropped for a missed one
    embedding_row_host_bytes: int = 0  # bytes read from the host table
    embedding_rows_resident: int = 0  # rows on the device now
    embedding_row_capacity: int = 0  # rows the device keeps at most
    # What runs (constant): the weight precision the engine holds, e.g. "bfloat16", "float32" (a 16-bit
    # core run upcast), "int4-g32" (a quantized core on helios' native kernels) or its dequantized dtype
    # (helios.engine.quantized.QuantizedLoad.in_memory).
    weights_in_memory: str = ""
