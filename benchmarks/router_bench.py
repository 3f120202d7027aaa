"""Multi-conversation workload over helios replicas behind vllm-router: cache-aware vs round robin.

    python benchmarks/router_bench.py CORE [--replicas 2] [--conversations 8] [--turns 6]
        [--policies cache_aware,round_robin] [--router vllm-router] [--json out.json]

For each policy it starts fresh replicas of CORE (each its own prefix cache, no host store) and
vllm-router on loopback, then runs the conversations concurrently: each has its own long system
prompt and asks `--turns` questions in turn, sending the whole history (its earlier answers
included) every turn, as a chat client does. Reported per policy:

  hit rate     prompt tokens served from a replica's prefix cache / all prompt tokens
               (usage.prompt_tokens_details.cached_tokens summed; the replicas' /metrics
               reused_tokens delta must agree)
  throughput   requests/s and (prompt + generated) tokens/s over the run's wall time
  per replica  the requests each served

The numbers are only comparable on a quiet machine: other load changes the throughput, not the
hit rate. The router comes from `pip install -e '.[router]'` (or --router PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

WORDS = (
    "river stone light market engine garden winter signal harbor paper mountain silver window story "
    "number forest candle bridge machine orange letter ocean thunder planet music shadow circle"
).split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, log: Path, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready in {seconds:.0f} s")


def start_replica(core: Path, tmp: Path, key: str, settings: dict[str, object]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    lines = ["[server]", f'api_key = "{key}"', "host_cache = false"] + [
        f"{k} = {json.dumps(v)}" for k, v in settings.items()
    ]
    config = tmp / f"replica-{port}.toml"
    config.write_text("\n".join(lines) + "\n")
    log = tmp / f"replica-{port}.log"
    command = [sys.executable, "-m", "helios", "serve", str(core), "--config", str(config), "--port", str(port)]
    process = subprocess.Popen(command + ["--log-level", "warning"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", process, log)
    return url, process


def start_router(router: str, workers: list[str], policy: str, key: str, tmp: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = tmp / f"router-{policy}.log"
    command = [router, "--worker-urls", *workers, "--policy", policy, "--port", str(port)]
    command += ["--prometheus-port", str(free_port()), "--api-key", key, "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/readiness", process, log, 60)
    return url, process


def system_prompt(conversation: int, words: int) -> str:
    picked = [WORDS[(conversation * 7 + i * (conversation + 3)) % len(WORDS)] for i in range(words)]
    return f"Conversation {conversation}. You answer in one sentence about: " + " ".join(picked)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds: float


async def conversation(
    client: httpx.AsyncClient, url: str, key: str, index: int, args: argparse.Namespace
) -> list[Turn]:
    messages = [{"role": "system", "content": system_prompt(index, args.system_words)}]
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Question {turn}: what does {WORDS[turn]} remind you of?"})
        body = {"model": "x", "messages": messages, "max_tokens": args.max_tokens, "top_k": 1, "seed": index}
        started = time.perf_counter()
        response = await client.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        response.raise_for_status()
        answer = response.json()
        usage = answer["usage"]
        turns.append(
            Turn(
                index,
                turn,
                usage["prompt_tokens"],
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                usage["completion_tokens"],
                time.perf_counter() - started,
            )
        )
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
    return turns


def metrics(url: str) -> dict:
    return httpx.get(url + "/metrics?format=json", timeout=30).json()


def run_policy(core: Path, policy: str, args: argparse.Namespace) -> dict:
    key = "router-bench-key"
    tmp = Path(tempfile.mkdtemp(prefix=f"router-bench-{policy}-"))
    processes: list[subprocess.Popen] = []
    try:
        replicas = []
        for _ in range(args.replicas):
            url, process = start_replica(core, tmp, key, {"kv_pages": args.kv_pages, "max_concurrency": 8})
            replicas.append(url)
            processes.append(process)
        router, process = start_router(args.router, replicas, policy, key, tmp)
        processes.append(process)
        before = [metrics(url) for url in replicas]

        async def everything() -> list[Turn]:
            async with httpx.AsyncClient(timeout=600) as client:
                runs = [conversation(client, router, key, i, args) for i in range(args.conversations)]
                return [turn for turns in await asyncio.gather(*runs) for turn in turns]

        started = time.perf_counter()
        turns = asyncio.run(everything())
        wall = time.perf_counter() - started
        after = [metrics(url) for url in replicas]
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    generated = sum(t.completion_tokens for t in turns)
    reused = sum(a["reused_tokens"] - b["reused_tokens"] for a, b in zip(after, before))
    return {
        "policy": policy,
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "replica_reused_tokens": reused,
        "hit_rate": cached / prompt if prompt else 0.0,
        "generated_tokens": generated,
        "wall_seconds": wall,
        "requests_per_second": len(turns) / wall,
        "tokens_per_second": (prompt + generated) / wall,
        "generated_tokens_per_second": generated / wall,
        "per_replica_requests": [a["completed"] - b["completed"] for a, b in zip(after, before)],
        "turns": [asdict(t) for t in turns],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300, help="words in each conversation's system prompt")
    parser.add_argument("--kv-pages", type=int, default=2048)
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--router", default=shutil.which("vllm-router", path=str(Path(sys.executable).parent)))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.router:
        parser.error("no vllm-router: pip install -e '.[router]' or pass --router PATH")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = [run_policy(args.core, policy, args) for policy in args.policies.split(",")]
    print(f"{'policy':<12} {'requests':>8} {'hit rate':>9} {'req/s':>7} {'tok/s':>8} {'gen tok/s':>9}  per replica")
    for r in results:
        print(
            f"{r['policy']:<12} {r['requests']:>8} {r['hit_rate']:>9.1%} {r['requests_per_second']:>7.2f} "
            f"{r['tokens_per_second']:>8.1f} {r['generated_tokens_per_second']:>9.1f}  {r['per_replica_requests']}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
