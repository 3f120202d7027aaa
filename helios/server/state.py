"""Everything the routes share: configuration, core, frontend, engine client, counters."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable

from helios.config import ConfigError, ServerConfig
from helios.core import Core
from helios.core.logs import Stopwatch
from helios.engine import devices
from helios.engine.client import EngineClient
from helios.core.manifest import Manifest
from helios.engine.draft_core import incompatibility
from helios.engine.drafter import SpeculationConfig
from helios.engine.engine import EngineConfig, HostCacheConfig, LLMEngine
from helios.engine.host_store import default_directory, default_memory_bytes
from helios.frontend.constraint import GrammarMasks
from helios.frontend.generate import Runner
from helios.frontend.parsers.reasoning import reasoning_delimiters
from helios.frontend.request import Frontend
from helios.protocols.models import ModelIdentity, card, flare_object, identity
from helios.server.admission import AdmissionSlots
from helios.server.metrics import FirstResponseWindow

T = TypeVar("T")
HEAVY_REQUEST_BYTES = 1 << 20  # requests with bodies past this do their frontend work on the heavy pool
REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("helios_request_bytes", default=0)


@dataclass
class ServerState:
    config: ServerConfig
    core: Core
    frontend: Frontend
    client: EngineClient
    runner: Runner
    slots: AdmissionSlots
    pool: ThreadPoolExecutor
    heavy_pool: ThreadPoolExecutor
    model: ModelIdentity
    card: dict[str, Any]
    started: float
    first_response: FirstResponseWindow

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU-bound frontend work (tokenization, rendering) off the event loop.

        Work for a request with a large body runs on the one-thread heavy pool, so a few
        expensive requests queue behind each other instead of occupying every frontend thread.
        """
        pool = self.heavy_pool if REQUEST_BYTES.get() > HEAVY_REQUEST_BYTES else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def histograms(self) -> dict[str, Any]:
        """Prometheus histogram name -> helios.engine.host_store.Histogram (none without a host store)."""
        host = self.client.engine.host
        if host is None:
            return {}
        stats = host.stats
        return {
            "flare_host_cache_missing_tokens": stats.missing_tokens,
            "flare_host_cache_estimated_transfer_ns": stats.transfer_ns,
            "flare_host_cache_estimated_prefill_ns": stats.prefill_ns,
        }

    def snapshot(self) -> dict[str, Any]:
        stats = self.client.engine.stats
        values = {
            name: getattr(stats, name)
            for name in (
                "prefill_tokens",
                "generated_tokens",
                "decode_weight_bytes",
                "verification_rounds",
                "active",
                "pending",
                "completed",
                "failed",
                "reused_tokens",
                "cached_pages",
                "free_pages",
                "total_pages",
                "page_tokens",
                "reasoning_budget_cuts",
                "verify_steps",
                "verification_drafts",
                "accepted_drafts",
                "draft_rounds",
                "draft_steps",
                "state_slots",
                "state_slot_bytes",
                "state_slots_used",
                "state_snapshots",
                "checkpoint_anchor_reservations",
            )
        }
        values.update(stats.images)  # image preparation and feature counters (engine), plus the frontend's
        for name, count in self.frontend.image_counters.items():
            values[name] = values.get(name, 0) + count
        values.update(
            checkpoint_captures=dict(stats.checkpoint_captures),
            checkpoint_skips=dict(stats.checkpoint_skips),
            checkpoint_extra_work_nanoseconds_total=stats.checkpoint_extra_work_ns,
        )
        scheduler = self.client.engine.scheduler
        slots = scheduler.copy_out.checkpoint_slots
        values.update(
            host_cache_slots_in_use=slots[0], host_cache_slots_total=slots[1], host_cache_intake_slots=slots[2]
        )
        host = self.client.engine.host
        if host is not None:
            stats_h = host.stats
            values.update(
                host_hits=stats_h.hits,
                host_reused_tokens=stats_h.reused_tokens,
                host_memory_records=host.memory_records,
                host_disk_records=host.disk_records,
                host_bytes_out=stats_h.bytes_out,
                host_bytes_in=stats_h.bytes_in,
                host_cache_parked_records=host.parked_records,
                host_cache_store_skipped_total=stats_h.skipped,
                host_cache_held=dict(stats_h.held),
                host_cache_anchor_records=host.anchor_records,
                host_cache_copyout_pinned_records=scheduler.copy_out.pinned_records,
                host_cache_copyout_headroom_deferrals_total=stats_h.copy_deferrals,
                host_cache_copyout_waits_total=stats_h.copy_waits,
                host_cache_copyout_wait_nanoseconds_total=stats_h.copy_wait_ns,
                host_cache_copyout_worker_nanoseconds_total=scheduler.copy_out.copier_ns,
                host_cache_dropped={f"{tier}/{reason}": n for (tier, reason), n in stats_h.dropped.items()},
            )
        speculation = self.client.engine.scheduler.drafter
        values.update(
            preemptions_total=stats.preemptions,
            state_rewinds_total=stats.state_rewinds,
            used_pages=stats.total_pages - stats.free_pages - stats.cached_pages,
            # api.md: learned_drafter is a boolean; which drafter it is goes beside it (JSON only):
            # "mtp" for the core's MTP programs, a draft core's model id, or null.
            learned_drafter=speculation.learned_name is not None,
            learned_drafter_name=speculation.learned_name,
            learned_draft_tokens_total=stats.learned_offered,
            learned_accepted_draft_tokens_total=stats.learned_accepted,
            history_drafts_enabled=int(
                speculation.enabled and speculation.config.history and speculation.config.shared_history
            ),
            http_admission_in_use=self.slots.in_use,
            http_admission_capacity=self.slots.capacity,
            uptime_seconds=int(time.time() - self.started),
            graph_launches=dict(self.client.engine.executor.launches),  # by kind: graph (CUDA replay), eager
        )
        # Speculative counters by depth (drafts a request round offered), batch (decode rows in a
        # verification step) and width (1 + the most drafts any row group of the step carried).
        for label, table in (
            ("depth", stats.rounds_by_depth),
            ("batch", stats.steps_by_batch),
            ("width", stats.steps_by_width),
        ):
            for key, count in sorted(dict(table).items()):
                values[f"speculative_{'rounds' if label == 'depth' else 'steps'}_{label}_{key}_total"] = count
        return values


def host_cache_config(config: ServerConfig) -> HostCacheConfig | None:
    if not config.host_cache:
        return None
    memory = config.host_cache_memory_mb << 20 if config.host_cache_memory_mb is not None else default_memory_bytes()
    directory = Path(config.host_cache_dir).expanduser() if config.host_cache_dir else default_directory()
    return HostCacheConfig(
        memory,
        directory if config.host_cache_disk_mb else None,
        config.host_cache_disk_mb << 20,
        config.host_cache_copy_queue_mb << 20,
    )


def _draft_core(config: ServerConfig, target: Manifest) -> Core | None:
    """The draft core named by [server] draft_core / --draft-core, checked against the served core."""
    if config.draft_core is None or config.speculation == "off" or not config.learned_drafts:
        return None
    draft = Core.open(Path(config.draft_core).expanduser(), trust_unchanged=True)
    why = incompatibility(target, draft.manifest)
    if why is not None:
        raise ConfigError(f"[server] draft_core / --draft-core {config.draft_core}: {why}")
    return draft


def resolve_device(config: ServerConfig) -> str:
    """The torch device of [server] device ("auto": CUDA where torch sees one); ConfigError where CUDA
    is asked for and this host has none."""
    try:
        return devices.resolve(config.device)
    except devices.DeviceError as exc:
        raise ConfigError(str(exc)) from None


def build_state(core_dir: Path, config: ServerConfig) -> ServerState:
    clock = Stopwatch(logging.getLogger("helios.server"), "startup")
    core = Core.open(core_dir, trust_unchanged=True)
    clock.lap("opening the core (checksums)")
    m = core.manifest
    if config.thinking_token_budget is not None and (
        m.recipe.reasoning_syntax is None or reasoning_delimiters(m.recipe.reasoning_syntax, core.tokenizer()) is None
    ):
        raise ConfigError(
            "[server] thinking_token_budget needs a core whose reasoning syntax closes with a single-token delimiter; "
            f"recipe {m.recipe.name!r} has none (reasoning syntax {m.recipe.reasoning_syntax!r}): remove the setting"
        )
    device = resolve_device(config)
    cuda = devices.is_cuda(device)
    draft = _draft_core(config, m)
    # kv_memory_mb unset: 1 GiB on CPU; on CUDA the pool is sized from free device memory (devices.kv_pages_for)
    kv_bytes = config.kv_memory_mb << 20 if config.kv_memory_mb is not None else (None if cuda else 1 << 30)
    try:
        engine = LLMEngine(
            core,
            EngineConfig(
                max_concurrency=config.max_concurrency,
                max_pending=config.queue_size,
                prefill_chunk_size=config.prefill_chunk_size,
                num_pages=config.kv_pages,
                kv_memory_bytes=kv_bytes,
                enable_prefix_cache=config.prefix_cache,
                reclaim_window_pages=config.window_pool,
                image_cache_bytes=config.image_cache_mb << 20,
                device=device,
                cuda_graphs=cuda and config.cuda_graphs,
                kv_memory_fraction=config.kv_memory_fraction,
                serial_decode_rows=config.serial_decode_rows,
                compiled_step=config.compiled_step,
                speculation=SpeculationConfig(
                    config.speculation,
                    config.max_draft_tokens,
                    config.speculative_rows,
                    config.history_drafts,
                    learned=config.learned_drafts,
                ),
                draft_core=draft,
                state_snapshots=config.state_snapshots,
                snapshot_interval=config.snapshot_interval,
                anchor_guards=config.anchor_guards,
                checkpoint_work_fraction=config.checkpoint_work_fraction,
                host_cache=host_cache_config(config),
            ),
            mask_hook=GrammarMasks(m.tokenizer.vocab_size, config.grammar_threads),
        )
    except devices.DeviceError as exc:  # the KV pool does not fit on the device
        raise ConfigError(str(exc)) from None
    client = EngineClient(engine).start()
    clock.lap("starting the engine")
    frontend = Frontend(core, config)
    frontend.grammars.probe.start()  # its worker builds the tokenizer while the server starts
    clock.lap("starting the frontend")
    created = int(time.time())
    model = identity(m, config.aliases, created)
    flare = flare_object(
        m,
        max_concurrency=config.max_concurrency,
        prefill_chunk_size=config.prefill_chunk_size,
        default_max_tokens=frontend.default_max_tokens,
        thinking_token_budget=config.thinking_token_budget,
        image_limits=frontend.image_limits(),
        device=device,
        cuda_graphs=engine.executor.graphs is not None,
    )
    return ServerState(
        config=config,
        core=core,
        frontend=frontend,
        client=client,
        runner=Runner(frontend, client),
        slots=AdmissionSlots(config.http_slots),
        pool=ThreadPoolExecutor(config.frontend_workers, "helios-frontend"),
        heavy_pool=ThreadPoolExecutor(1, "helios-frontend-heavy"),
        model=model,
        card=card(model, m, engine.max_model_len, flare),
        started=time.time(),
        first_response=FirstResponseWindow(),
    )
