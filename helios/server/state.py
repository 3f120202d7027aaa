"""Everything the routes share: configuration, core, frontend, engine client, counters."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from helios.config import ConfigError, ServerConfig
from helios.core import Core
from helios.core.logs import Stopwatch
from helios.core.manifest import Manifest
from helios.engine import (
    DeviceError,
    EngineClient,
    EngineConfig,
    EngineMetrics,
    HistogramSnapshot,
    ParallelWorld,
    RowCacheConfig,
    SpeculationConfig,
    build_engine,
    draft_core_incompatibility,
    is_cuda,
)
from helios.engine import resolve_device as resolve_engine_device
from helios.frontend.constraint import GrammarMasks
from helios.frontend.generate import Runner
from helios.frontend.image_cache import host_cache_config
from helios.frontend.prepare import default_budget_problem
from helios.frontend.request import Frontend
from helios.protocols.models import ModelIdentity, card, flare_object, identity
from helios.server import ranks
from helios.server.admission import AdmissionSlots
from helios.server.metrics import FirstResponseWindow, ServerCounters, histograms_of, values_of
from helios.server.outcomes import Outcome, RequestOutcomes

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
    outcomes: RequestOutcomes = field(default_factory=RequestOutcomes)  # api.md completed / failed

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU-bound frontend work (tokenization, rendering) off the event loop.

        Work for a request with a large body runs on the one-thread heavy pool, so a few
        expensive requests queue behind each other instead of occupying every frontend thread.
        """
        pool = self.heavy_pool if REQUEST_BYTES.get() > HEAVY_REQUEST_BYTES else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def scrape(self) -> Scrape:
        """One /metrics read: the engine's snapshot and the server's counters, taken once for both
        expositions."""
        engine = self.client.metrics()
        return Scrape(_values(self, engine), self.first_response.summary(), histograms_of(engine))

    def snapshot(self) -> dict[str, Any]:
        """The flat metrics mapping (JSON field name -> value) now (metrics.values_of)."""
        return _values(self, self.client.metrics())


def _values(state: ServerState, engine: EngineMetrics) -> dict[str, Any]:
    server = ServerCounters(
        http_admission_in_use=state.slots.in_use,
        http_admission_capacity=state.slots.capacity,
        uptime_seconds=int(time.time() - state.started),
        image_counters=dict(state.frontend.image_counters),
        completed=state.outcomes.count(Outcome.COMPLETED),
        failed=state.outcomes.count(Outcome.FAILED),
    )
    return values_of(engine, server)


@dataclass(frozen=True, slots=True)
class Scrape:
    """What one GET /metrics renders, in either format."""

    values: dict[str, Any]  # JSON field name -> value (metrics.values_of)
    first_response: dict[str, Any]  # FirstResponseWindow.summary()
    histograms: dict[str, HistogramSnapshot]  # Prometheus name -> state; empty without a host prefix store


def _draft_core(config: ServerConfig, target: Manifest) -> Core | None:
    """The draft core named by [server] draft_core / --draft-core, checked against the served core."""
    if config.draft_core is None or config.speculation == "off" or not config.learned_drafts:
        return None
    draft = Core.open(Path(config.draft_core).expanduser(), trust_unchanged=True)
    why = draft_core_incompatibility(target, draft.manifest)
    if why is not None:
        raise ConfigError(f"[server] draft_core / --draft-core {config.draft_core}: {why}")
    return draft


def resolve_device(config: ServerConfig) -> str:
    """The torch device of [server] device ("auto": CUDA where torch sees one); ConfigError where CUDA
    is asked for and this host has none."""
    try:
        return resolve_engine_device(config.device)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None


def build_state(core_dir: Path, config: ServerConfig, world: ParallelWorld | None = None) -> ServerState:
    """`world`: the joined ranks of a tensor-parallel engine (helios.server.ranks), None for one rank."""
    clock = Stopwatch(logging.getLogger("helios.server"), "startup")
    core = Core.open(core_dir, trust_unchanged=True)
    clock.lap("opening the core (checksums)")
    m = core.manifest
    frontend = Frontend(core, config)
    problem = default_budget_problem(frontend) if config.thinking_token_budget is not None else None
    if problem is not None:
        raise ConfigError(
            f"[server] thinking_token_budget cannot cap reasoning of recipe {m.recipe.name!r}: {problem}; "
            "remove the setting"
        )
    device = resolve_device(config)
    cuda = is_cuda(device)
    draft = _draft_core(config, m)
    # kv_memory_mb unset: 1 GiB on CPU; on CUDA the pool is sized from free device memory (devices.kv_pages_for)
    kv_bytes = config.kv_memory_mb << 20 if config.kv_memory_mb is not None else (None if cuda else 1 << 30)
    try:
        engine = build_engine(
            ranks.engine_core(core, world),
            EngineConfig(
                max_concurrency=config.max_concurrency,
                max_pending=config.queue_size,
                prefill_chunk_size=config.prefill_chunk_size,
                num_pages=config.kv_pages,
                kv_memory_bytes=kv_bytes,
                enable_prefix_cache=config.prefix_cache,
                reclaim_window_pages=config.window_pool,
                packed_kv_pages=config.packed_kv_pages,
                image_cache_bytes=config.image_cache_mb << 20,
                row_cache=RowCacheConfig(config.embedding_row_cache_rows, config.embedding_rows_source),
                device=device,
                cuda_graphs=cuda and config.cuda_graphs,
                kv_memory_fraction=config.kv_memory_fraction,
                serial_decode_rows=config.serial_decode_rows,
                compiled_step=config.compiled_step,
                runtime=config.runtime,
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
                parallel=world,
            ),
            mask_hook=GrammarMasks(m.tokenizer.vocab_size, config.grammar_threads),
        )
    except DeviceError as exc:  # the KV pool does not fit on the device
        raise ConfigError(str(exc)) from None
    client = EngineClient(engine).start()
    if world is not None:
        ranks.watch(world, client)
    running = client.metrics()  # what runs: device, CUDA graphs, context limit
    clock.lap("starting the engine")
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
        cuda_graphs=running.cuda_graphs,
        upcast_from=running.upcast_from,
        weights_in_memory=running.weights_in_memory,
    )
    # docs/parallel.md: the ranks the engine runs on, and over how many its experts are split
    flare["tensor_parallel"] = world.size if world is not None else 1
    flare["expert_parallel"] = world.size if world is not None and world.plan.expert else 1
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
        card=card(model, m, running.max_model_len, flare),
        started=time.time(),
        first_response=FirstResponseWindow(),
    )
