"""Tensor parallel against one rank on this machine: the same core served by `helios serve` at TP=1
(THREADS torch threads in one process) and at TP=2 (THREADS / 2 threads in each rank's process),
streamed chats at each concurrency level through serve_bench, and each rank's resident memory.

    python benchmarks/tp_bench.py CORE [--levels 1,16,64] [--tokens 128] [--threads 2] [--expert-parallel]
                                       [--config helios.toml] [--json out.json]

The core must declare tensor-parallel size 2 (`ignition export ... --tensor-parallel 1,2`). Memory is read
from /proc/PID/status of rank 0 (the server) and of the worker ranks it starts, once the server is ready
and again after the sweep: VmRSS, its file-backed part RssFile (the mapped weight shard) and anonymous
part RssAnon (KV pool, activations, the runtime), and VmHWM (the peak). Run it on a quiet machine: both
configurations use every core the machine gives them, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench  # noqa: E402  (the load generator beside this script)

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident memory fields (MiB) from /proc/PID/status."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            values[key] = round(int(rest.split()[0]) / 1024, 1)  # kB
    return values


def rank_pids(server: int) -> list[int]:
    """Rank 0 (the server) then the worker ranks it started (python -m helios.engine.parallel)."""
    children = Path(f"/proc/{server}/task/{server}/children").read_text().split()
    workers = [int(p) for p in children if b"helios.engine.parallel" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return [server, *workers]


class Server:
    """`helios serve CORE` at `tensor` ranks with `threads` torch threads a rank, logging to `log`."""

    def __init__(self, core: Path, tensor: int, threads: int, expert: bool, config: Path | None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "helios", "serve", str(core), "--port", str(self.port)]
        if tensor > 1:
            command += ["--tensor-parallel", str(tensor), "--master-port", str(free_port())]
            command += ["--expert-parallel"] if expert else []
        command += ["--config", str(config)] if config else []
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = log
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, seconds: float = 900) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"helios exited ({self.process.returncode}): {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # waiting for the server to open its port and load
        self.stop()
        raise SystemExit(f"helios was not healthy within {seconds:.0f} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drains, then stops every rank
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def measure(args: argparse.Namespace, tensor: int, threads: int) -> dict:
    """One configuration: serve, note each rank's memory, sweep the levels, note the memory again."""
    log = Path(args.logs) / f"tp{tensor}.log"
    server = Server(args.core, tensor, threads, args.expert_parallel and tensor > 1, args.config, log)
    try:
        server.wait_ready()
        pids = rank_pids(server.process.pid)
        if len(pids) != tensor:
            raise SystemExit(f"expected {tensor} rank processes, found {pids}")
        report: dict = {"tensor": tensor, "threads_per_rank": threads, "log": str(log)}
        report["memory_ready_mib"] = {f"rank{r}": memory_mib(pid) for r, pid in enumerate(pids)}
        sweep = {}
        for level in args.levels:
            sweep[str(level)] = asyncio.run(
                serve_bench.concurrent(server.url, args.model, level, rounds=args.rounds, tokens=args.tokens)
            )
            print(
                f"TP={tensor} x {threads} threads, {level} streams: {sweep[str(level)]['output_tok_s']} tok/s",
                flush=True,
            )
        report["sweep"] = sweep
        report["memory_after_mib"] = {f"rank{r}": memory_mib(pid) for r, pid in enumerate(pids)}
        return report
    finally:
        server.stop()


def table(results: list[dict], levels: list[int]) -> str:
    """A markdown table: output tok/s and ITL p50 per level, then each rank's resident memory."""
    head = "| ranks x threads | " + " | ".join(f"{n} streams tok/s (ITL p50 ms)" for n in levels) + " |"
    lines = [head, "|" + "---|" * (len(levels) + 1)]
    for r in results:
        cells = [f"{r['sweep'][str(n)]['output_tok_s']} ({r['sweep'][str(n)]['itl_p50_ms']})" for n in levels]
        lines.append(f"| {r['tensor']} x {r['threads_per_rank']} | " + " | ".join(cells) + " |")
    lines += ["", "| ranks | rank | VmRSS MiB | RssFile (weights) | RssAnon | VmHWM |", "|---|---|---|---|---|---|"]
    for r in results:
        for rank, m in r["memory_after_mib"].items():
            lines.append(f"| {r['tensor']} | {rank} | {m['VmRSS']} | {m['RssFile']} | {m['RssAnon']} | {m['VmHWM']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--levels", default="1,16,64", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=serve_bench.OUTPUT_TOKENS, help="output tokens a request")
    parser.add_argument("--rounds", type=int, default=2, help="requests a level sends, times the level")
    parser.add_argument("--threads", type=int, default=2, help="torch threads at TP=1 (TP=2: half a rank)")
    parser.add_argument("--expert-parallel", action="store_true", help="TP=2 with the experts split")
    parser.add_argument("--config", type=Path, help="a helios TOML both servers read (e.g. [kv] sizes)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--logs", default=".", help="where the servers' logs go")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.levels = [int(n) for n in args.levels.split(",")]
    if args.threads < 2 or args.threads % 2:
        raise SystemExit("--threads must be even (TP=2 gives each rank half)")
    results = [measure(args, 1, args.threads), measure(args, 2, args.threads // 2)]
    report = {"core": str(args.core), "tokens": args.tokens, "results": results, "table": table(results, args.levels)}
    print(report["table"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
