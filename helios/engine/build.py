"""build_engine: the parts one core runs with, sized from the engine config and the core's manifest,
handed to LLMEngine (engine.py), which only keeps them.

Pools first (their sizes decide the executor's caches), then the executor, the scheduler over the
pools with the host prefix store, and the learned drafter; CUDA graphs are captured last, once the
drafters have widened the caches they read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from helios.core import Core
from helios.core.onnx_program import OnnxProgram
from helios.engine import devices, precision
from helios.engine.engine import EngineConfig, LLMEngine
from helios.engine.executor import Executor
from helios.engine.memory.checkpoints import StepCosts
from helios.engine.memory.host_copy import Copier
from helios.engine.memory.host_store import HostStore, identity_of
from helios.engine.memory.kv_cache import PagePool
from helios.engine.memory.state_slots import StatePool
from helios.engine.memory.window_pages import WindowPages, min_pool_pages, pool_pages
from helios.engine.quantized import dequantized_growth
from helios.engine.request import EngineStats
from helios.engine.sampler import Sampler
from helios.engine.scheduler import Scheduler, SchedulerConfig
from helios.engine.speculation.draft_core import DraftCoreDrafter
from helios.engine.speculation.drafter import DraftPicker, MaskHook, SpeculationConfig
from helios.engine.speculation.mtp import MTP_CACHE, MtpDrafter, mtp_kinds

log = logging.getLogger("helios.engine")

# Hybrid cores with speculation: spare live state slots, each lent to one drafting sequence for a
# step (its state before verification). Speculation pays at low concurrency, where few sequences
# draft at once; a sequence finding none free decodes without drafts that step.
ROLLBACK_SLOTS = 8


def build_engine(core: Core, config: EngineConfig, mask_hook: MaskHook | None = None) -> LLMEngine:
    """The engine for `core`: KV pools sized from `config`, executor, scheduler, drafters, sampler.

    `mask_hook` masks constrained rows before sampling (the frontend's grammar masks)."""
    m = core.manifest
    upcast_from = _upcast_from(core, config)
    kv_dtype = "float32" if upcast_from else m.kv.dtype
    pool, window = _kv_pools(core, config, kv_dtype)
    stats = EngineStats(
        total_pages=pool.num_pages, page_tokens=pool.page_tokens, decode_weight_bytes=m.decode_weight_bytes
    )
    states = _state_pool(core, config, stats)
    speculation = config.speculation
    learned_drafts = speculation.mode != "off" and speculation.learned
    mtp = mtp_kinds(m.programs) if learned_drafts and config.draft_core is None else ()
    executor_options = dict(
        device=config.device,
        serial_decode_rows=config.serial_decode_rows,
        upcast=upcast_from is not None,
        compiled=config.compiled_step and config.runtime == "torch",
        num_slots=states.num_slots if states else 1,
        drafters=mtp,
        cuda_graphs=config.cuda_graphs and devices.is_cuda(config.device),
        num_window_pages=window.pool.num_pages if window is not None else None,
        row_cache=config.row_cache,
        runtime=config.runtime,
        packed_pages=config.packed_kv_pages,
    )
    if config.parallel is not None:  # rank 0 of N: every call goes to the other ranks too
        from helios.engine.parallel.proxy import RankZeroExecutor

        executor: Executor = RankZeroExecutor(config.parallel, core, pool.num_pages, **executor_options)
    else:
        executor = Executor(core, pool.num_pages, **executor_options)  # type: ignore[arg-type]
    if executor.compiled_fallback:
        log.warning("%s", executor.compiled_fallback)
    _attach_image_encoder(core, config, executor, stats)
    costs = StepCosts()
    if states is not None:
        _measure_state_copy(config, executor, costs, stats)
    if speculation.mode == "adaptive" and speculation.row_budget is None:  # only adaptive mode keeps a budget
        speculation = replace(speculation, row_budget=executor.speculation_rows(core))
    max_model_len = min(config.max_model_len or m.limits.max_model_len, m.limits.max_model_len)
    scheduler = _scheduler(
        core, config, max_model_len, speculation, kv_dtype, pool, window, states, stats, costs, executor
    )
    learned: MtpDrafter | DraftCoreDrafter | None = None
    if mtp:
        learned = _mtp_drafter(core, config, mtp, pool.page_tokens, speculation, executor, stats)
    elif learned_drafts and config.draft_core is not None:
        learned = DraftCoreDrafter(
            config.draft_core,
            m,
            pool.num_pages,
            config.device,
            speculation.max_drafts,
            config.max_concurrency,
            config.prefill_chunk_size,
            stats,
        )
    scheduler.drafter.learned = learned
    if learned is not None:  # learned drafts follow the grammar of a constrained sequence
        learned.picker = DraftPicker(mask_hook)
    engine = LLMEngine(
        core,
        config,
        max_model_len=max_model_len,
        upcast_from=upcast_from,
        stats=stats,
        pool=pool,
        window=window,
        states=states,
        costs=costs,
        executor=executor,
        scheduler=scheduler,
        learned=learned,
        sampler=Sampler(),
        mask_hook=mask_hook,
    )
    engine._refresh_gauges()
    if executor.graphs is not None:  # after the drafters widened the caches the graphs read
        _remember_graph_memory(core, config, executor.capture_graphs())
    return engine


def _graph_memory_key(core: Core, config: EngineConfig) -> str:  # pragma: no cover - needs a GPU
    return devices.graph_memory_key(
        core.digest, devices.device_name(config.device), core.manifest.decode_buckets, torch.__version__
    )


def _remember_graph_memory(core: Core, config: EngineConfig, measured: dict[int, int]) -> None:
    """Keep what capturing each bucket took on this device for the next start's pool sizing (the
    pool is allocated before its graphs are captured, which read it), and say how it compares
    with what this start set aside."""
    if not measured or not devices.is_cuda(config.device):
        return
    key = _graph_memory_key(core, config)  # pragma: no cover - needs a GPU
    set_aside = devices.graph_reserve(core.manifest.decode_buckets, devices.remembered_graph_bytes(key))
    devices.remember_graph_bytes(key, measured)
    taken = sum(measured.values())
    log.info("CUDA graphs: capture took %d MiB (%d MiB was set aside)", taken >> 20, set_aside >> 20)
    if taken > set_aside and config.num_pages is None and config.kv_memory_bytes is None:
        log.warning(
            "CUDA graphs took %d MiB more than the KV pool left for them; the next start sizes the pool "
            "from this measurement",
            (taken - set_aside) >> 20,
        )


def _upcast_from(core: Core, config: EngineConfig) -> str | None:
    """A 16-bit core runs upcast to fp32 only on a CPU where no 16-bit kernel (oneDNN's, or for
    bf16 helios' own, AVX2 ones included) is competitive with fp32: measured, precision.is_native."""
    dtype = core.manifest.weights.dtype
    native = (
        config.device != "cpu" or dtype not in ("bfloat16", "float16") or precision.is_native(getattr(torch, dtype))
    )
    return None if native else dtype


def _kv_pools(core: Core, config: EngineConfig, kv_dtype: str) -> tuple[PagePool, WindowPages | None]:
    """The main KV pool and, for cores whose sliding-window layers keep a window pool, theirs."""
    m = core.manifest
    element = torch.tensor([], dtype=getattr(torch, kv_dtype)).element_size()
    page = m.limits.page_tokens
    main_bytes = m.kv.token_elements * page * element
    window_page_bytes = m.kv.window_token_elements * page * element  # 0 without window caches
    # One pool for every cache tensor: what the budget holds (the window caches, if any, as large).
    num_pages = config.num_pages or _pool_pages(core, config, main_bytes + window_page_bytes)
    pooled = m.kv.window_pool if config.reclaim_window_pages else None
    if pooled is None:
        return PagePool(num_pages, page), None
    # As many window pages as that one pool (equal token capacity), at most what running
    # sequences can hold at once, at least what one needs; the bytes saved go to the main pool.
    drafts = config.speculation.max_drafts if config.speculation.mode != "off" else 0
    most = pool_pages(pooled.window, page, config.max_concurrency, config.prefill_chunk_size, drafts)
    num_window_pages = max(min_pool_pages(pooled.window, page, config.prefill_chunk_size), min(most, num_pages))
    if main_bytes:  # (a core whose every layer slides keeps page ids only in the main pool)
        num_pages = max(1, num_pages + (num_pages - num_window_pages) * window_page_bytes // main_bytes)
    log.info(
        "window pool: the sliding layers' caches hold %d pages (%d MiB), freed %d tokens behind each "
        "query; the other layers' pool %d pages",
        num_window_pages,
        num_window_pages * window_page_bytes >> 20,
        pooled.window,
        num_pages,
    )
    return PagePool(num_pages, page), WindowPages(PagePool(num_window_pages, page), pooled.window)


def _pool_pages(core: Core, config: EngineConfig, page_bytes: int) -> int:
    """KV pages of a pool given by bytes; on CUDA without a size, from the device's free memory
    less the weights still to load and the graphs' reserve (devices.kv_pages_for)."""
    if config.kv_memory_bytes is not None or not devices.is_cuda(config.device):
        return max(1, (1 << 30 if config.kv_memory_bytes is None else config.kv_memory_bytes) // page_bytes)
    # (a quantized core's weights are dequantized on a GPU: they take more than their file)
    weights = (core.root / core.manifest.weights.file).stat().st_size + dequantized_growth(core.manifest.quantization)
    # The graphs' share: what capturing them took here before (measured), else the estimate.
    measured = devices.remembered_graph_bytes(_graph_memory_key(core, config)) if config.cuda_graphs else None
    reserve = devices.graph_reserve(core.manifest.decode_buckets, measured) if config.cuda_graphs else 0
    free = devices.free_device_bytes(config.device)
    pages = devices.kv_pages_for(max(0, free - weights), config.kv_memory_fraction, page_bytes, reserve)
    log.info(
        "KV pool: %d pages from %d MiB free on %s (%d MiB of weights to load, %d MiB kept for CUDA graphs, %s)",
        pages,
        free >> 20,
        config.device,
        weights >> 20,
        reserve >> 20,
        "measured at an earlier capture" if measured else "estimated: not yet captured on this device",
    )
    return pages


def _state_pool(core: Core, config: EngineConfig, stats: EngineStats) -> StatePool | None:
    """Hybrid cores' recurrent-state slots: live ones, prefix snapshots, and rollback spares."""
    kv = core.manifest.kv
    if not kv.state:
        return None
    snapshots = config.max_concurrency if config.state_snapshots is None else config.state_snapshots
    # Speculation lends spare live slots for rollback copies (scheduler: drafting hybrids).
    spare = min(config.max_concurrency, ROLLBACK_SLOTS) if config.speculation.mode != "off" else 0
    states = StatePool(config.max_concurrency, snapshots, config.anchor_guards, spare)
    stats.state_slots = states.num_slots
    stats.state_slot_bytes = kv.slot_bytes
    return states


def _attach_image_encoder(core: Core, config: EngineConfig, executor: Executor, stats: EngineStats) -> None:
    """Vision cores: the encoder that prepares and encodes images when prefill reaches them."""
    vision = core.manifest.vision
    if executor.vision is None or vision is None:
        return
    from helios.engine.images import ImageEncoder

    # A compiled step keeps no torch weights; an ONNX vision program holds its own (none needed).
    weights = executor.weights or ({} if isinstance(executor.vision, OnnxProgram) else core.load_weights(config.device))
    executor.images = ImageEncoder(
        executor.vision,
        weights,
        vision.feature_dim,
        vision.image_feature_window_tokens * config.max_concurrency,
        config.device,
        stats,
        config.image_cache_bytes,
    )


def _measure_state_copy(config: EngineConfig, executor: Executor, costs: StepCosts, stats: EngineStats) -> None:
    """The state-copy rate hinted checkpoints are charged at: a few slot copies onto themselves."""
    copies = 4
    started = time.perf_counter_ns()
    for _ in range(copies):
        executor.copy_state(0, 0)
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()
    costs.observe_copy(copies * stats.state_slot_bytes, time.perf_counter_ns() - started)


def _scheduler(
    core: Core,
    config: EngineConfig,
    max_model_len: int,
    speculation: SpeculationConfig,
    kv_dtype: str,
    pool: PagePool,
    window: WindowPages | None,
    states: StatePool | None,
    stats: EngineStats,
    costs: StepCosts,
    executor: Executor,
) -> Scheduler:
    """The scheduler over the pools, with the host prefix store and its copier when configured."""
    m = core.manifest
    page = m.limits.page_tokens
    interval = config.snapshot_interval
    if interval is None:
        interval = max(page, config.prefill_chunk_size // page * page)
    host = _host_store(core, config, kv_dtype, pool, window, executor)
    copier = Copier(host, executor.page_caches, executor.state) if host is not None else None
    return Scheduler(
        SchedulerConfig(
            config.max_concurrency,
            config.prefill_chunk_size,
            max_model_len,
            frozenset(m.tokenizer.eos_token_ids),
            -(-interval // page) * page,
            config.checkpoint_work_fraction,
            "attention_until" in executor.step.input_names,
        ),
        pool,
        stats,
        speculation,
        states,
        host,
        executor.page_bytes,
        costs,
        copier,
        config.host_cache.copy_queue_bytes if config.host_cache is not None else 0,
        window,
    )


def _host_store(
    core: Core, config: EngineConfig, kv_dtype: str, pool: PagePool, window: WindowPages | None, executor: Executor
) -> HostStore | None:
    host = config.host_cache
    if host is None:
        return None
    if config.parallel is not None:
        log.warning("host cache: off at --tensor-parallel > 1 (its records are not per-rank yet; docs/parallel.md)")
        return None
    m = core.manifest
    if window is not None:
        log.warning(
            "host cache: off for this core: its sliding layers' pages are reclaimed behind the window "
            "(reclaim_window_pages), which the host store's records do not cover yet"
        )
        return None
    shapes = m.kv.cache_shapes() if not m.kv.state else (m.kv.cache_shapes(), m.kv.state_shapes())
    identity = identity_of(core.digest, kv_dtype, m.limits.page_tokens, shapes)
    store = HostStore(identity, host.memory_bytes, host.directory, host.disk_bytes)
    # The copy-in rate for the store's lookup estimates: a few pages read and written back in place.
    pages = list(range(min(8, pool.num_pages)))
    started = time.perf_counter_ns()
    executor.write_pages(tuple(zip(pages, executor.read_pages(pages))))
    store.copy_ns_per_byte = (time.perf_counter_ns() - started) / (len(pages) * executor.page_bytes)
    log.info(
        "host prefix store: %d MiB in memory, %s",
        host.memory_bytes >> 20,
        f"{host.disk_bytes >> 20} MiB on disk in {store.directory}" if store.disk_bytes else "no disk tier",
    )
    return store


def _mtp_drafter(
    core: Core,
    config: EngineConfig,
    kinds: tuple[str, ...],
    page: int,
    speculation: SpeculationConfig,
    executor: Executor,
    stats: EngineStats,
) -> MtpDrafter:
    """The core's MTP programs as the learned drafter, its caches widened by scratch pages
    (enough for every live sequence's speculative rows past its own pages)."""
    kv = core.manifest.kv
    first = kv.num_caches - sum(len(e.layers) for e in kv.extra)
    indexes, index = [], first
    for extra in kv.extra:
        if extra.name == MTP_CACHE:
            indexes += range(index, index + len(extra.layers))
        index += len(extra.layers)
    log.info("speculation: drafting with the core's %d MTP layer(s) (%s)", len(kinds), ", ".join(kinds))
    return MtpDrafter(
        executor, kinds, tuple(indexes), page, speculation.max_drafts // page + 2, config.max_concurrency, stats
    )
