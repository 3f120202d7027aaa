"""The host prefix store across restarts, and prefill work in a growing agent conversation.

    python benchmarks/prefix_store_bench.py cores/smollm2 [--json out.json]

restart       a ~4,000-token chat prompt, 1 output token: TTFT on a fresh server with an empty
              store (cold), then after stopping it and starting a new server on the same store
              directory (warm: the pages come from the disk tier)
conversation  10 turns of one chat, each appending ~500 tokens of user text to the history
              and the previous answer (64 tokens); total prompt tokens the server prefilled
              (/metrics prefill_tokens) against the final conversation's length
One server at a time, on a temporary store directory; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ROOT, free_port, helios_command, stop, wait_healthy  # noqa: E402
from serve_bench import filler  # noqa: E402


def serve(core: Path, store: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = workdir / "prefix-bench.toml"
    config.write_text(
        f'[server]\nkv_pages = 2048\nprefill_chunk_size = 512\nhost_cache_dir = "{store}"\nspeculation = "off"\n'
    )
    process = subprocess.Popen(helios_command(core, port, config), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return process, url


def ttft(url: str, messages: list[dict], max_tokens: int = 1) -> tuple[float, dict, str]:
    """(seconds to the first streamed content, usage, answer text)."""
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, usage, text = None, {}, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    return (first or time.perf_counter()) - start, usage, "".join(text)


def metrics(url: str) -> dict:
    return httpx.get(url + "/metrics?format=json", timeout=30).json()


def restart(core: Path, workdir: Path) -> dict:
    store = workdir / "store-restart"
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": filler(3970, seed=7) + "\nSummarise the above in one word."},
    ]
    process, url = serve(core, store, workdir)
    try:
        cold, usage, _ = ttft(url, messages)
    finally:
        stop(process)  # waits for the store's disk writes
    process, url = serve(core, store, workdir)
    try:
        warm, warm_usage, _ = ttft(url, messages)
        host = metrics(url)
    finally:
        stop(process)
    cached = (warm_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "cold_ttft_s": round(cold, 3),
        "warm_ttft_s": round(warm, 3),
        "warm_over_cold": round(warm / cold, 3),
        "warm_cached_tokens": cached,
        "host_disk_records": host.get("host_disk_records"),
        "host_bytes_in": host.get("host_bytes_in"),
    }


def conversation(core: Path, workdir: Path, turns: int = 10) -> dict:
    process, url = serve(core, workdir / "store-conversation", workdir)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    try:
        before = metrics(url)["prefill_tokens"]
        final = 0
        for turn in range(turns):
            messages.append({"role": "user", "content": filler(400, seed=100 + turn)})
            _, usage, answer = ttft(url, messages, max_tokens=64)
            messages.append({"role": "assistant", "content": answer})
            final = usage["prompt_tokens"] + usage["completion_tokens"]
        prefilled = metrics(url)["prefill_tokens"] - before
    finally:
        stop(process)
    return {
        "turns": turns,
        "final_length": final,
        "prefilled_tokens": prefilled,
        "prefill_over_final": round(prefilled / final, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        results = {
            "restart": restart(args.core.resolve(), Path(tmp)),
            "conversation": conversation(args.core.resolve(), Path(tmp)),
            "cpus": os.cpu_count(),
        }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
