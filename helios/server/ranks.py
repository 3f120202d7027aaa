"""`helios serve` at N tensor-parallel ranks: which part this process plays (docs/parallel.md).

Rank 0 serves HTTP: it starts this machine's other ranks and joins the world before the engine is
built. A headless process (another machine's first rank, or a torchrun rank other than 0) runs its
ranks until rank 0 stops them and serves no HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from helios.config import ConfigError, ServerConfig
from helios.core import Core
from helios.engine import (
    EngineClient,
    ParallelError,
    ParallelWorld,
    parallel_plan,
    rank_core,
    serve_headless_rank,
    start_parallel,
)


def wanted(config: ServerConfig, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process takes part in a multi-rank engine ([parallel] tensor > 1, or torchrun)."""
    return config.parallel.tensor > 1 or ("RANK" in env and "WORLD_SIZE" in env)


def join(core_dir: Path, config: ServerConfig, device: str, log_level: str) -> ParallelWorld | int:
    """Rank 0: the joined world (ConfigError where the core lacks the size or the ranks cannot form).
    Any other rank: its exit status once rank 0 stopped it."""
    p = config.parallel
    core = Core.open(core_dir, trust_unchanged=True)
    try:
        plan = parallel_plan(
            p.tensor, p.expert, p.nnodes, p.node_rank, p.master_addr, p.master_port, p.timeout_s, os.environ
        )
        rank_core(core, plan.tensor, plan.rank, plan.expert)  # an undeclared size is refused before any rank starts
        if plan.rank != 0 or p.headless:
            if plan.rank == 0:
                raise ConfigError("--headless: this process is rank 0, which serves HTTP (--node-rank 0)")
            return serve_headless_rank(core, plan, device, log_level)
        return start_parallel(core, plan, device, log_level)
    except ParallelError as exc:
        raise ConfigError(str(exc)) from None


def watch(world: ParallelWorld, client: EngineClient) -> None:
    """A lost rank stops the engine: open requests end with an error, /health answers 503."""

    def lost(reason: str) -> None:
        client.failure = f"the engine stopped: {reason}"
        client.fail_open(client.failure)

    world.on_failure.append(lost)


def engine_core(core: Core, world: ParallelWorld | None) -> Core:
    """The core the engine runs: rank 0's view of it at N ranks."""
    return core if world is None else rank_core(core, world.size, 0, world.plan.expert)
