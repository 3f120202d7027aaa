"""Engine throughput on a core, next to the machine's physical ceiling.

    python benchmarks/engine_bench.py cores/smollm2 [--tokens 64] [--batches 1,8,32] [--json out.json]
    python benchmarks/engine_bench.py cores/smollm2 --grammar [--tokens 64] [--grammar-threads 1]
    python benchmarks/engine_bench.py cores/smollm2 --device cuda [--no-graphs] [--batches 1,8,32,128]

Measures decode tokens/s for 1, 8 and 32 concurrent sequences (greedy, ignore_eos,
prompts already prefilled), and estimates the ceiling of each from measured fp32 matmul
FLOP/s at that row count and measured matrix-vector memory bandwidth:
step time >= max(weight bytes / bandwidth, 2 * parameters * rows / FLOP/s).

--grammar instead compares 16 concurrent JSON-schema-constrained requests (a schema too
long to finish within --tokens, so every row stays masked) against 16 unconstrained ones
on the same engine, and prints the throughput cost of the grammar masks (target <= 15%).

--device cuda[:N] runs the engine on a GPU with CUDA graphs for decode steps (--no-graphs: eager);
the CPU ceiling is not estimated there, and each row reports the step launches by kind instead.
Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import SamplingParams
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint, GrammarMasks
from helios.frontend.grammar import GrammarService

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of an fp32 matrix-vector product over a matrix much larger than cache."""
    rows = megabytes * (1 << 20) // 4 // 4096
    matrix, vector = torch.randn(rows, 4096), torch.randn(4096)
    torch.mv(matrix, vector)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mv(matrix, vector)
    return matrix.numel() * 4 * repeats / (time.perf_counter() - start)


def measure_flops(rows: int, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(rows, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * rows * size * size * repeats / (time.perf_counter() - start)


def decode_throughput(
    engine: LLMEngine, tokenizer, batch: int, tokens: int, constraint: GrammarConstraint | None = None, tag: str = ""
) -> float:
    """Aggregate generated tokens/s of `batch` sequences, counting decode steps only."""
    requests = [
        EngineRequest(
            f"b{batch}{tag}-{i}",
            tuple(tokenizer.encode(f"Request {i}: write about the sea.").ids),
            (GREEDY,),
            tokens + 1,
            ignore_eos=constraint is None,
            constraint=constraint,
        )
        for i in range(batch)
    ]
    for request in requests:
        engine.add(request)
    while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first sampled token) is not part of the decode figure
    generated = engine.stats.generated_tokens
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    return (engine.stats.generated_tokens - generated) / (time.perf_counter() - start)


# Never complete within the measured tokens: at least 1000 short strings.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "minItems": 1000, "items": {"type": "string", "maxLength": 12}}},
    "required": ["notes"],
    "additionalProperties": False,
}


def grammar_overhead(core: Core, tokens: int, threads: int, batch: int = 16, rounds: int = 2) -> dict:
    """Best-of-rounds decode tokens/s of `batch` constrained vs unconstrained requests."""
    m = core.manifest
    engine = build_engine(
        core, EngineConfig(num_pages=4096, max_concurrency=256), mask_hook=GrammarMasks(m.tokenizer.vocab_size, threads)
    )
    tokenizer = core.tokenizer()
    service = GrammarService(tokenizer, m.tokenizer.vocab_size, tuple(m.tokenizer.eos_token_ids))
    constraint = GrammarConstraint(
        service.compile("json_schema", json.dumps(LONG_SCHEMA), "bench"), ConstraintPlan(None, None, frozenset(), False)
    )
    free, masked = 0.0, 0.0
    for index in range(rounds):  # alternate, so drift on a shared machine hits both
        free = max(free, decode_throughput(engine, tokenizer, batch, tokens, tag=f"u{index}"))
        masked = max(masked, decode_throughput(engine, tokenizer, batch, tokens, constraint, tag=f"c{index}"))
    return {
        "core": str(core.root),
        "batch": batch,
        "tokens": tokens,
        "grammar_threads": threads,
        "unconstrained_tokens_per_s": round(free, 1),
        "constrained_tokens_per_s": round(masked, 1),
        "slowdown": round(1 - masked / free, 3),
    }


def device_throughput(core: Core, args: argparse.Namespace) -> dict:
    """Decode tokens/s on a GPU per batch, with the step launches by kind (graph replays, eager)."""
    engine = build_engine(
        core, EngineConfig(num_pages=4096, max_concurrency=256, device=args.device, cuda_graphs=not args.no_graphs)
    )
    tokenizer = core.tokenizer()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        before = dict(engine.executor.launches)
        measured = decode_throughput(engine, tokenizer, batch, args.tokens)
        launches = {kind: count - before[kind] for kind, count in engine.executor.launches.items()}
        rows.append({"batch": batch, "tokens_per_s": round(measured, 1), "launches": launches})
    return {
        "core": str(args.core),
        "device": args.device,
        "cuda_graphs": engine.executor.graphs is not None,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--grammar", action="store_true", help="measure the cost of grammar masks instead")
    parser.add_argument("--grammar-threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--no-graphs", action="store_true", help="CUDA: run decode steps eagerly")
    args = parser.parse_args()
    core = Core.open(args.core, verify_checksums=False)
    if args.grammar:
        report = grammar_overhead(core, args.tokens, args.grammar_threads)
        print(
            f"core {args.core}: {report['batch']} concurrent requests, {report['tokens']} tokens each, "
            f"{report['grammar_threads']} grammar thread(s)"
        )
        print(
            f"unconstrained {report['unconstrained_tokens_per_s']} tok/s, json_schema-constrained "
            f"{report['constrained_tokens_per_s']} tok/s: {100 * report['slowdown']:.1f}% slower (target <= 15%)"
        )
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return
    m = core.manifest
    if args.device != "cpu":
        report = device_throughput(core, args)
        print(json.dumps(report, indent=2))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return
    engine = build_engine(core, EngineConfig(num_pages=4096, max_concurrency=256))
    tokenizer = core.tokenizer()
    bandwidth = measure_bandwidth()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        measured = decode_throughput(engine, tokenizer, batch, args.tokens)
        flops = measure_flops(batch)
        step = max(m.decode_weight_bytes / bandwidth, 2 * m.weights.num_parameters * batch / flops)
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": round(measured, 1),
                "ceiling_tokens_per_s": round(batch / step, 1),
                "fraction_of_ceiling": round(measured * step / batch, 3),
                "matmul_gflops": round(flops / 1e9, 1),
            }
        )
    report = {
        "core": str(args.core),
        "threads": torch.get_num_threads(),
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "decode_weight_mb": round(m.decode_weight_bytes / 1e6, 1),
        "rows": rows,
    }
    print(
        f"core {args.core}: {report['decode_weight_mb']} MB weights/token, bandwidth {report['bandwidth_gb_s']} GB/s, "
        f"{report['threads']} threads"
    )
    print(f"{'batch':>5}  {'tok/s':>8}  {'ceiling':>8}  {'fraction':>8}  {'GFLOP/s':>8}")
    for row in rows:
        print(
            f"{row['batch']:>5}  {row['tokens_per_s']:>8}  {row['ceiling_tokens_per_s']:>8}  "
            f"{row['fraction_of_ceiling']:>8}  {row['matmul_gflops']:>8}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
