"""Starting and stopping the ranks of `helios serve --tensor-parallel N`.

One machine: rank 0 (the server) starts ranks 1..N-1 as worker processes. Several machines
(`--nnodes K --node-rank I`): node I's process is rank I * N/K and starts the node's other N/K - 1
ranks; node 0's first rank serves HTTP, the others run `--headless`. Under torchrun every rank is
its own process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are read) and starts none.
"""

from __future__ import annotations

import atexit
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

from helios.core import Core
from helios.engine.parallel.worker import rank_device, serve_rank
from helios.engine.parallel.world import ParallelPlan, World, WorldError

log = logging.getLogger("helios.engine")


def plan_from(
    tensor: int,
    expert: bool,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    env: Mapping[str, str],
) -> ParallelPlan:
    """This process's part: from torchrun's variables where they are set, else from the flags."""
    if "RANK" in env and "WORLD_SIZE" in env:
        size = int(env["WORLD_SIZE"])
        if tensor not in (1, size):
            raise WorldError(f"--tensor-parallel {tensor} but torchrun started WORLD_SIZE={size} ranks")
        return ParallelPlan(
            tensor=size,
            expert=expert,
            rank=int(env["RANK"]),
            master_addr=env.get("MASTER_ADDR", master_addr),
            master_port=int(env.get("MASTER_PORT", master_port)),
            timeout_s=timeout_s,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            store_hosted=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if nnodes < 1 or tensor % nnodes:
        raise WorldError(f"--tensor-parallel {tensor} is not divisible by --nnodes {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise WorldError(f"--node-rank {node_rank} must be between 0 and --nnodes - 1 ({nnodes - 1})")
    per = tensor // nnodes
    first = node_rank * per
    return ParallelPlan(
        tensor=tensor,
        expert=expert,
        rank=first,
        local_ranks=tuple(range(first + 1, first + per)),
        master_addr=master_addr,
        master_port=master_port,
        timeout_s=timeout_s,
    )


def _spawn(core: Core, plan: ParallelPlan, device: str, log_level: str) -> list[subprocess.Popen]:
    procs = []
    for rank in plan.local_ranks:
        command = [sys.executable, "-m", "helios.engine.parallel", str(core.root), "--with-parent"]
        command += ["--rank", str(rank), "--local-rank", str(rank - plan.rank)]
        command += ["--tensor-parallel", str(plan.tensor), "--timeout", str(plan.timeout_s)]
        command += ["--master-addr", plan.master_addr, "--master-port", str(plan.master_port)]
        command += ["--device", device, "--log-level", log_level]
        if plan.expert:
            command.append("--expert-parallel")
        procs.append(subprocess.Popen(command))
    return procs


def _dead(procs: list[subprocess.Popen], plan: ParallelPlan) -> str | None:
    gone = [(rank, p.returncode) for rank, p in zip(plan.local_ranks, procs, strict=True) if p.poll() is not None]
    if not gone:
        return None
    return "worker " + ", ".join(f"rank {rank} exited ({code})" for rank, code in gone)


def _reap(procs: list[subprocess.Popen], wait_s: float = 5.0) -> None:
    for p in procs:
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()


def start(core: Core, plan: ParallelPlan, device: str, log_level: str = "info") -> World:
    """(rank 0) Start this node's workers and join the world: WorldError (workers stopped) where it
    cannot form. The returned world stops its ranks at exit."""
    procs = _spawn(core, plan, device, log_level)
    world = World(plan, rank_device(device, plan.local_rank))
    world.watch = lambda: _dead(procs, plan)
    try:
        world.join(core)
    except BaseException:
        for p in procs:
            p.terminate()
        _reap(procs, 2.0)
        raise

    def stop() -> None:
        if world.failure == "stopped":
            return
        world.stop()
        _reap(procs)

    atexit.register(stop)
    _stop_on_signals(stop)
    return world  # its heartbeat starts once every rank's executor is built (proxy.RankZeroExecutor)


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM/SIGINT end rank 0 after the server's drain (uvicorn raises the signal again once it has
    shut down, and no atexit handler runs then): stop the other ranks first, then take the signal's
    previous course. Main thread only (helios serve calls start there); elsewhere atexit alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(number)

        def handler(signum: int, frame: object, previous: object = previous) -> None:
            stop()
            signal.signal(signum, previous if callable(previous) else signal.SIG_DFL)  # type: ignore[arg-type]
            signal.raise_signal(signum)

        signal.signal(number, handler)


def run_headless(core: Core, plan: ParallelPlan, device: str, log_level: str = "info") -> int:
    """(a node's first rank, not rank 0; or any torchrun rank but 0) Start this node's other ranks,
    then serve as a rank until rank 0 stops it."""
    procs = _spawn(core, plan, device, log_level)
    try:
        return serve_rank(core, plan, device)
    finally:
        _reap(procs)
