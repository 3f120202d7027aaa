"""The ranks of one tensor-parallel engine: rendezvous, identity check, process groups, commands.

Rank 0 hosts a TCPStore at master_addr:master_port; every rank writes its identity there (core
digest, helios and torch versions, the size it was started for). Rank 0 waits up to the timeout for
all of them, names the ranks that never joined, refuses mismatched identities, and publishes its
verdict; then every rank joins the torch.distributed process group (gloo on CPU, NCCL on CUDA) whose
timeout is the deadline of every collective. The group named "tp" (helios.core.ops.collectives)
runs the programs' collectives; a second gloo group carries rank 0's commands to the other ranks.

Rank 0's commands (World.command) hold one lock from the broadcast to the end of its own part, so
the ranks meet every collective in the same order; a heartbeat keeps idle workers' waits inside the
deadline and notices a lost rank while no request runs. Any failure of a command or a heartbeat is
fatal: the world is marked failed, the `on_failure` callbacks hear why, and every later command
raises RankLost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from helios.core import Core
from helios.core import manifest as mf
from helios.core.ops import collectives

log = logging.getLogger("helios.engine")
T = TypeVar("T")
_JOINED = "flare/joined/"
_VERDICT = "flare/verdict"
_READY = "flare/ready/"
STARTUP_S = 900.0  # building a rank's executor (first-use native kernel builds included)
OK = "ok"


class RankLost(BaseException):
    """A rank died, hung past the collective deadline, or failed a command: the engine cannot go on.

    A BaseException on purpose: a failed step fails only its own requests (LLMEngine.step catches
    Exception), but a lost rank must stop the engine thread, which fails every open request and
    makes /health answer 503 (EngineClient)."""


class WorldError(RuntimeError):
    """The ranks could not form a world (a rank missing, mismatched, or unreachable)."""


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """How this process takes part: the sizes, where rank 0 listens, and which ranks run here."""

    tensor: int  # ranks in all (tensor-parallel size)
    expert: bool = False  # the core's experts split across the ranks (its layout must say so)
    rank: int = 0  # this process's rank
    local_ranks: tuple[int, ...] = ()  # ranks this process starts as worker processes
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0  # rendezvous and every collective's deadline
    local_rank: int = 0  # this process's device index among the node's ranks (CUDA)
    store_hosted: bool = False  # torchrun's agent already hosts the store at master_port (every rank a client)


def layout(core: Core, size: int, expert: bool) -> mf.ParallelLayout:
    """The core's layout for `size` ranks; an undeclared size (or expert mode) is refused, naming the
    declared sizes and the export flag."""
    declared = core.manifest.parallel
    found = declared.layouts.get(str(size))
    if found is None:
        sizes = ", ".join(map(str, declared.tensor))
        raise WorldError(
            f"--tensor-parallel {size}: the core declares tensor-parallel sizes {sizes}; re-export it with "
            f"`ignition export ... --tensor-parallel {','.join(map(str, sorted({*declared.tensor, size})))}`"
        )
    if found.expert != expert:
        flag = "with" if found.expert else "without"
        raise WorldError(
            f"the core's {size}-rank layout was exported {flag} --expert-parallel: serve it {flag} --expert-parallel"
        )
    return found


def rank_core(core: Core, size: int, rank: int, expert: bool) -> Core:
    """The core as rank `rank` of `size` sees it: its weight shard, the rank programs, its caches;
    no compiled step (a rank program is portable only, for now)."""
    found = layout(core, size, expert)
    manifest = core.manifest
    view = _replace(manifest, weights=found.weights[rank], programs=found.programs, kv=found.kv, compiled={})
    return Core(core.root, view)


def _replace(manifest: mf.Manifest, **changes: Any) -> mf.Manifest:
    import msgspec

    return msgspec.structs.replace(manifest, **changes)


def identity(core: Core, plan: ParallelPlan) -> dict[str, object]:
    """What every rank must agree on."""
    import helios

    return {
        "core": core.digest,
        "helios": helios.__version__,
        "torch": str(torch.__version__),
        "tensor": plan.tensor,
        "expert": plan.expert,
    }


class World:
    """This process's rank, its groups, and (rank 0) the command channel to the others."""

    def __init__(self, plan: ParallelPlan, device: str) -> None:
        self.plan = plan
        self.rank = plan.rank
        self.size = plan.tensor
        self.device = device
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self.watch: Callable[[], str | None] | None = None  # a local check (launch: dead child processes)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopping = threading.Event()
        self.control: Any = None
        self.store: Any = None

    # ------------------------------------------------------------------ joining
    def join(self, core: Core) -> None:
        """Rendezvous (WorldError naming missing or mismatched ranks), then the process groups."""
        plan = self.plan
        timeout = timedelta(seconds=plan.timeout_s)
        where = f"{plan.master_addr}:{plan.master_port}"
        try:
            store = dist.TCPStore(
                plan.master_addr,
                plan.master_port,
                self.size,
                is_master=self.rank == 0 and not plan.store_hosted,
                timeout=timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise WorldError(f"rank {self.rank}: cannot reach rank 0's rendezvous at {where}: {exc}") from None
        self.store = store
        mine = identity(core, plan)
        store.set(f"{_JOINED}{self.rank}", json.dumps(mine))
        if self.rank == 0:
            self._admit(store, mine)
        else:
            try:
                verdict = store.get(_VERDICT).decode()
            except RuntimeError as exc:
                raise WorldError(f"rank {self.rank}: rank 0 at {where} never admitted this rank: {exc}") from None
            if verdict != OK:
                raise WorldError(f"rank {self.rank}: refused by rank 0: {verdict}")
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        collectives.bind(collectives.TENSOR_GROUP, dist.group.WORLD)
        log.info("parallel: rank %d of %d joined (%s, deadline %.0f s)", self.rank, self.size, backend, plan.timeout_s)

    def _admit(self, store: Any, mine: dict[str, object]) -> None:
        deadline = time.monotonic() + self.plan.timeout_s
        others = range(1, self.size)
        while True:
            missing = [r for r in others if not store.check([f"{_JOINED}{r}"])]
            if not missing:
                break
            if time.monotonic() > deadline or (self.watch is not None and self.watch() is not None):
                why = f" ({self.watch()})" if self.watch is not None and self.watch() else ""
                verdict = f"ranks {missing} did not join within {self.plan.timeout_s:.0f} s{why}"
                store.set(_VERDICT, verdict)
                raise WorldError(f"parallel startup failed: {verdict}")
            time.sleep(0.05)
        for r in others:
            theirs = json.loads(store.get(f"{_JOINED}{r}"))
            wrong = {k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v}
            if wrong:
                detail = "; ".join(f"{k}: rank 0 has {a!r}, rank {r} has {b!r}" for k, (a, b) in wrong.items())
                verdict = f"rank {r} does not match rank 0 ({detail})"
                store.set(_VERDICT, verdict)
                raise WorldError(f"parallel startup failed: {verdict}")
        store.set(_VERDICT, OK)

    def ready(self, startup_s: float) -> None:
        """Every rank, once its executor is built: wait (up to startup_s, which covers first-use kernel
        builds) until every rank is; WorldError naming the ranks that were not. Commands start after."""
        self.store.set(f"{_READY}{self.rank}", OK)
        deadline = time.monotonic() + startup_s
        while missing := [r for r in range(self.size) if not self.store.check([f"{_READY}{r}"])]:
            problem = self.watch() if self.watch is not None else None
            if problem is not None or time.monotonic() > deadline:
                raise WorldError(
                    f"parallel startup failed: ranks {missing} were not ready within {startup_s:.0f} s"
                    + (f" ({problem})" if problem else "")
                )
            time.sleep(0.05)
        self._last = time.monotonic()

    # ------------------------------------------------------------------ rank 0's commands
    def command(self, message: tuple, local: Callable[[], T]) -> T:
        """Send `message` to every other rank, then run this rank's part (in that order, under the
        lock, so the ranks meet the collectives in the same order). Any failure is fatal: RankLost."""
        with self._lock:
            if self.failure is not None:
                raise RankLost(self.failure)
            try:
                self._send(message)
                result = local()
            except Exception as exc:  # noqa: BLE001 - at N ranks a failed command leaves them out of step
                self._fail(f"tensor-parallel rank lost during {message[0]}: {type(exc).__name__}: {exc}")
                raise RankLost(self.failure) from exc
            self._last = time.monotonic()
            return result

    def _send(self, message: tuple) -> None:
        problem = self.watch() if self.watch is not None else None
        if problem is not None:
            raise RuntimeError(problem)
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> tuple:
        """(other ranks) The next command from rank 0; RuntimeError once it is gone or past the deadline."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("parallel: %s", reason)
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - one listener's failure must not hide the others
                log.exception("parallel: a failure listener failed")

    def start_heartbeat(self) -> None:
        """(rank 0) Ping the other ranks whenever no command went out for a third of the deadline."""
        period = max(0.2, self.plan.timeout_s / 3)

        def beat() -> None:
            while not self._stopping.wait(min(period, 1.0)):
                if self.failure is not None:
                    return
                problem = self.watch() if self.watch is not None else None
                if problem is not None:
                    self._fail(problem)
                    return
                if time.monotonic() - self._last < period or not self._lock.acquire(blocking=False):
                    continue
                try:
                    self._send(("ping",))
                    self._last = time.monotonic()
                except Exception as exc:  # noqa: BLE001
                    self._fail(f"tensor-parallel heartbeat failed: {type(exc).__name__}: {exc}")
                finally:
                    self._lock.release()

        threading.Thread(target=beat, name="helios-parallel-heartbeat", daemon=True).start()

    def stop(self, wait_s: float = 5.0) -> None:
        """(rank 0) Tell the other ranks to exit (best effort: skipped after a failure or while a
        command holds the lock past `wait_s`)."""
        self._stopping.set()
        if self.failure is None and self._lock.acquire(timeout=wait_s):
            try:
                self._send(("stop",))
            except Exception as exc:  # noqa: BLE001
                log.warning("parallel: could not tell the other ranks to stop: %s", exc)
            finally:
                self._lock.release()
        self.failure = self.failure or "stopped"
        collectives.unbind(collectives.TENSOR_GROUP)
