"""Rank 0's executor at N ranks: every device-touching call goes to the other ranks first.

It is the one-rank Executor over rank 0's view of the core (its shard, the rank programs, its
caches), whose program launches and page and state copies are World commands: the call is
broadcast, then run here, and each rank runs the same call on its own executor (worker.py). The
step's inputs are built once, here; only rank 0 keeps sequence state.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from helios.core import Core
from helios.engine.executor import Executor
from helios.engine.parallel.world import STARTUP_S, World

# The calls a worker runs (worker.py): an Executor method name each, "launch" for a program call.
FORWARDED = ("launch", "copy_page", "copy_window_page", "copy_state", "write_states")


class RankZeroExecutor(Executor):
    def __init__(self, world: World, core: Core, num_pages: int, **options: Any) -> None:
        """`options` as Executor's (cuda_graphs and compiled steps are off at N ranks); the other
        ranks build their executors from the same options while this one builds."""
        self.world = world
        options.update(cuda_graphs=False, compiled=False, drafters=())
        worker_options = {k: v for k, v in options.items() if k != "serial_decode_rows"}
        world.command(("init", num_pages, worker_options), lambda: None)
        super().__init__(core, num_pages, **options)
        world.ready(max(STARTUP_S, world.plan.timeout_s))
        world.start_heartbeat()

    def _kind(self, program: Any) -> str:
        for kind, known in (("step", self.step), ("scored_prefill", self.scored)):
            if program is known:
                return kind
        raise ValueError("only the step and scored_prefill programs run at N ranks")

    def _launch(self, program, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        local = super()._launch
        return self.world.command(("launch", self._kind(program), inputs), lambda: local(program, inputs))

    def copy_page(self, src: int, dst: int) -> None:
        self.world.command(("copy_page", src, dst), lambda: super(RankZeroExecutor, self).copy_page(src, dst))

    def copy_window_page(self, src: int, dst: int) -> None:
        local = super().copy_window_page
        self.world.command(("copy_window_page", src, dst), lambda: local(src, dst))

    def copy_state(self, src: int, dst: int) -> None:
        self.world.command(("copy_state", src, dst), lambda: super(RankZeroExecutor, self).copy_state(src, dst))

    def write_pages(self, writes: tuple[tuple[int, Tensor], ...]) -> None:
        raise RuntimeError("the host prefix store is not per-rank yet: it is off at --tensor-parallel > 1")

    def write_states(self, writes: tuple[tuple[int, Tensor], ...]) -> None:
        raise RuntimeError("recurrent-state cores are not served at --tensor-parallel > 1 yet")
