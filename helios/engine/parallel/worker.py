"""A worker rank: join the world, build this rank's executor when rank 0 says how, then run rank 0's
commands on it until told to stop (or until rank 0 is gone or silent past the deadline).

Run as `python -m helios.engine.parallel CORE --rank R --tensor-parallel N ...` (launch.py
starts the local ones; `helios serve --headless` runs the same loop for a node's first rank).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from helios.core import Core
from helios.engine.executor import Executor
from helios.engine.parallel.proxy import FORWARDED
from helios.engine.parallel.world import STARTUP_S, ParallelPlan, World, WorldError, rank_core

log = logging.getLogger("helios.engine")


def rank_device(device: str, local_rank: int) -> str:
    """This rank's device: CUDA ranks take the node's device of their local rank."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def serve_rank(core: Core, plan: ParallelPlan, device: str = "cpu") -> int:
    """Run rank `plan.rank` until rank 0 stops it (0) or fails (1)."""
    world = World(plan, rank_device(device, plan.local_rank))
    try:
        world.join(core)
    except WorldError as exc:
        log.error("%s", exc)
        return 1
    executor: Executor | None = None
    try:
        while True:
            message = world.receive()
            op = message[0]
            if op == "stop":
                log.info("parallel: rank %d stopping", plan.rank)
                return 0
            if op == "ping":
                continue
            if op == "init":
                _, num_pages, options = message
                options["device"] = rank_device(options.get("device", "cpu"), plan.local_rank)
                executor = Executor(rank_core(core, plan.tensor, plan.rank, plan.expert), num_pages, **options)
                world.ready(max(STARTUP_S, plan.timeout_s))
                continue
            if executor is None or op not in FORWARDED:
                raise RuntimeError(f"unexpected command {op!r} from rank 0")
            if op == "launch":
                _, kind, inputs = message
                program = executor.step if kind == "step" else executor.scored
                executor._launch(program, {k: v.to(executor.device) for k, v in inputs.items()})
            else:
                getattr(executor, op)(*message[1:])
    except Exception as exc:  # noqa: BLE001 - rank 0 gone, past the deadline, or a failed command
        log.error("parallel: rank %d stops: %s: %s", plan.rank, type(exc).__name__, exc)
        return 1


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it dies (rank 0 killed)."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helios.engine.parallel")
    parser.add_argument("core", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--tensor-parallel", type=int, required=True)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--with-parent", action="store_true", help="exit when the launching process dies")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s")
    if args.with_parent:
        _die_with_parent()
    plan = ParallelPlan(
        tensor=args.tensor_parallel,
        expert=args.expert_parallel,
        rank=args.rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout_s=args.timeout,
        local_rank=args.local_rank,
    )
    core = Core.open(args.core, trust_unchanged=True)
    return serve_rank(core, plan, args.device)
