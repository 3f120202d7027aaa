"""Engine throughput on a core, next to the machine's physical ceiling.

    python benchmarks/engine_bench.py cores/smollm2 [--tokens 64] [--batches 1,8,32] [--json out.json]
    python benchmarks/engine_bench.py cores/smollm2 --grammar [--tokens 64] [--grammar-threads 1]
    python benchmarks/engine_bench.py cores/smollm2 --device cuda [--no-graphs] [--batches 1,8,32,128]
    python benchmarks/engine_bench.py cores/smollm2 --breakdown [--tokens 64]
    python benchmarks/engine_bench.py cores/smollm2 --prefill 2000 --sampling recipe [--threads 1]

Measures decode tokens/s for 1, 8 and 32 concurrent sequences (greedy, ignore_eos,
prompts already prefilled), and estimates the ceiling of each from measured fp32 matmul
FLOP/s at that row count and the host's measured read bandwidth (the best of an fp32
matrix-vector product and a sum over 256 MiB):
step time >= max(weight bytes / bandwidth, 2 * parameters * rows / FLOP/s).
It prints the per-token decode limit of the core (the bytes a decode step reads, as the engine
holds the weights: twice the stored bf16 bytes where it upcasts them, / bandwidth) and the
fraction of it each batch achieved (1 = every step streams the weights at full bandwidth).

Set FLARE_CPU_ISA=avx2 (with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
TORCHINDUCTOR_CPP_MARCH=haswell, read when torch starts: helios/cpu_isa.py) to measure an
AVX-512 host as an AVX2 one; this script applies them itself when it is the first to load torch.

--grammar instead compares 16 concurrent JSON-schema-constrained requests (a schema too
long to finish within --tokens, so every row stays masked) against 16 unconstrained ones
on the same engine, and prints the throughput cost of the grammar masks (target <= 15%).

Each decode row also gives the process's CPU time per step (on a shared, busy machine the wall clock
is unreliable; one thread's CPU time is not). --sampling recipe decodes with the core's recipe
defaults (e.g. temperature 0.2, top_p 0.9: the sampler's passes over the vocabulary count) instead of
greedy. --prefill N also measures prefill: a prompt of N tokens (distinct per round, so no prefix
reuse), chunked as the engine chunks it, to its first token; best of 3, tokens/s and CPU seconds.
--threads N runs the engine on N threads (default: the engine's choice).

--breakdown times one stream's decode steps in parts (module step_breakdown): the engine step, the
executor's inputs, the step program, and the core's linears alone next to the bandwidth limit.

--device cuda[:N] runs the engine on a GPU with CUDA graphs for decode steps (--no-graphs: eager);
the CPU ceiling is not estimated there, and each row reports the step launches by kind instead.
Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from helios import cpu_isa, hugepages

cpu_isa.apply()  # before torch starts (FLARE_CPU_ISA)
hugepages.keep_freed_memory()  # as `helios serve` does

import torch  # noqa: E402

from helios.core import Core  # noqa: E402
from helios.core.program import STEP  # noqa: E402
from helios.engine import EngineConfig, LLMEngine, build_engine, prepack  # noqa: E402
from helios.engine.request import EngineRequest  # noqa: E402
from helios.engine.sampling_params import SamplingParams  # noqa: E402
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint, GrammarMasks  # noqa: E402
from helios.frontend.grammar import GrammarService  # noqa: E402

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Read bytes/s over a matrix much larger than cache: the best single pass of an fp32
    matrix-vector product and of a sum (whichever streams faster on this host)."""
    rows = megabytes * (1 << 20) // 4 // 4096
    matrix, vector = torch.randn(rows, 4096), torch.randn(4096)
    best = float("inf")
    for read in (lambda: torch.mv(matrix, vector), matrix.sum):
        read()
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    return matrix.numel() * 4 / best


def measure_flops(rows: int, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(rows, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * rows * size * size * repeats / (time.perf_counter() - start)


def recipe_sampling(core: Core) -> SamplingParams:
    """The core's recipe defaults as one choice's parameters (seed 0 where the recipe has none)."""
    d = core.manifest.recipe.sampling.defaults
    return SamplingParams(
        d.temperature,
        d.top_p,
        d.top_k,
        d.min_p,
        d.repetition_penalty,
        d.presence_penalty,
        d.frequency_penalty,
        d.seed or 0,
    )


def decode_throughput(
    engine: LLMEngine,
    tokenizer,
    batch: int,
    tokens: int,
    constraint: GrammarConstraint | None = None,
    tag: str = "",
    params: SamplingParams = GREEDY,
) -> float:
    """Aggregate generated tokens/s of `batch` sequences, counting decode steps only."""
    return decode_run(engine, tokenizer, batch, tokens, constraint, tag, params)[0]


def decode_run(
    engine: LLMEngine,
    tokenizer,
    batch: int,
    tokens: int,
    constraint: GrammarConstraint | None = None,
    tag: str = "",
    params: SamplingParams = GREEDY,
) -> tuple[float, float]:
    """decode_throughput, and the process's CPU milliseconds per decode step."""
    requests = [
        EngineRequest(
            f"b{batch}{tag}-{i}",
            tuple(tokenizer.encode(f"Request {i}: write about the sea.").ids),
            (params,),
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
    start, cpu, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    cpu_ms = 1e3 * (time.process_time() - cpu) / max(1, steps)
    return (engine.stats.generated_tokens - generated) / (time.perf_counter() - start), cpu_ms


def prefill_throughput(engine: LLMEngine, tokenizer, tokens: int, rounds: int = 3) -> dict:
    """Best-of-rounds prefill of a `tokens`-long prompt, chunked as the engine chunks it, up to its
    first sampled token: tokens/s, and the process's CPU seconds of that round. Each round's prompt
    starts with a different token, so no round reuses another's cached prefix."""
    text = " ".join(f"Line {i}: the sea keeps its own time, and the tide answers to the moon." for i in range(tokens))
    body = list(tokenizer.encode(text).ids)[: tokens - 1]
    best = (float("inf"), 0.0, 0)
    for index in range(rounds):
        engine.add(EngineRequest(f"prefill-{index}", (100 + index, *body), (GREEDY,), 1, ignore_eos=True))
        start, cpu, steps = time.perf_counter(), time.process_time(), 0
        while engine.has_work:
            engine.step()
            steps += 1
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu, steps))
    wall, cpu, steps = best
    return {
        "tokens": len(body) + 1,
        "steps": steps,
        "tokens_per_s": round((len(body) + 1) / wall, 1),
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
    }


def step_breakdown(engine: LLMEngine, core: Core, tokenizer, tokens: int, bandwidth: float, step_bytes: float) -> dict:
    """Where one stream's decode step goes: the whole engine step (scheduling, the step, sampling and
    bookkeeping), the executor's share (building the inputs and running the step), the step program
    alone, and, inside it, the core's linears alone on the kernel the engine uses (at one row,
    timed apart) next to the bandwidth limit of the bytes a step reads. Medians over the decode
    steps of one sequence (ms); tokens per step above 1 are speculation's."""
    executor = engine.executor
    spent: dict[str, list[float]] = {"run": [], "program": []}

    def timed(name: str, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - start)

        return wrapper

    executor.run, executor._launch = timed("run", executor.run), timed("program", executor._launch)
    steps: list[float] = []
    try:
        prompt = tuple(tokenizer.encode("Request 0: write about the sea.").ids)
        engine.add(EngineRequest("breakdown", prompt, (GREEDY,), tokens + 1, ignore_eos=True))
        while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        generated = engine.stats.generated_tokens
        for values in spent.values():
            values.clear()
        while engine.has_work:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    finally:
        del executor.run, executor._launch  # the instance's wrappers: the class's methods again
    alone = []  # the same program on one decode row, back to back (no engine work between calls)
    for _ in range(max(8, tokens // 4)):
        start = time.perf_counter()
        executor._probe_decode(1)
        alone.append(time.perf_counter() - start)
    median = lambda values: 1e3 * sorted(values)[len(values) // 2] if values else 0.0  # noqa: E731
    m = core.manifest
    program = core.load_program(STEP, check_guards=False)
    weights = core.load_weights("cpu")
    if engine.upcast_from:
        weights = {name: w.float() if w.is_floating_point() else w for name, w in weights.items()}
    names = prepack.linear_weights([program], weights)
    kernel = executor.linear_kernel if executor.linear_kernel in (*prepack.NATIVE_KERNELS, prepack.ONEDNN) else None
    if m.quantization is not None:  # its linears run on the quantized kernels, not a float one (qlinear_bench.py)
        kernel = None
    linears = prepack.measure_linears(kernel, 1, [weights[n] for n in names]) if kernel and names else None
    step, run, call = median(steps), median(spent["run"]), median(spent["program"])
    return {
        "tokens_per_step": round((engine.stats.generated_tokens - generated) / max(1, len(steps)), 2),
        "threads": torch.get_num_threads(),
        "step_ms": round(step, 2),
        "engine_ms": round(step - run, 2),
        "inputs_ms": round(run - call, 2),
        "program_ms": round(call, 2),
        "program_back_to_back_ms": round(median(alone), 2),
        "linears_ms": round(linears, 2) if linears is not None else None,
        "linear_mb": round(sum(weights[n].numel() * weights[n].element_size() for n in names) / 1e6, 1),
        "bandwidth_limit_ms": round(step_bytes / bandwidth * 1e3, 2),
        "decode_weight_mb": round(m.decode_weight_bytes * (2 if engine.upcast_from else 1) / 1e6, 1),
    }


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
        core,
        EngineConfig(
            num_pages=4096,
            max_concurrency=256,
            device=args.device,
            cuda_graphs=not args.no_graphs,
            async_output=_async_output(args),
        ),
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
        "async_output": engine.async_output,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)),
        "rows": rows,
    }


def _async_output(args: argparse.Namespace) -> bool | None:
    return None if args.async_output is None else args.async_output == "on"


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
    parser.add_argument(
        "--runtime",
        choices=("torch", "onnxruntime"),
        default="torch",
        help="CPU: the step programs on torch, or their ONNX renditions on ONNX Runtime (a core exported with --onnx)",
    )
    parser.add_argument(
        "--async-output",
        choices=("on", "off"),
        help="launch each step before reading the last one's tokens (helios/engine/overlap.py); default: the engine's",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="where one stream's decode step goes (engine, inputs, step, linears)"
    )
    parser.add_argument("--prefill", type=int, default=0, help="also measure prefill of a prompt this many tokens long")
    parser.add_argument(
        "--sampling", choices=("greedy", "recipe"), default="greedy", help="decode greedily or with the recipe defaults"
    )
    parser.add_argument("--threads", type=int, help="engine threads (default: the engine's)")
    args = parser.parse_args()
    core = Core.open(args.core, verify_checksums=False)
    if args.grammar:
        report = grammar_overhead(core, args.tokens, args.grammar_threads)
        lines = [
            f"core {args.core}: {report['batch']} concurrent requests, {report['tokens']} tokens each, "
            f"{report['grammar_threads']} grammar thread(s)",
            f"unconstrained {report['unconstrained_tokens_per_s']} tok/s, json_schema-constrained "
            f"{report['constrained_tokens_per_s']} tok/s: {100 * report['slowdown']:.1f}% slower (target <= 15%)",
        ]
        return _publish(lines, report, args.json)
    m = core.manifest
    if args.threads:
        torch.set_num_threads(args.threads)  # before the engine: its executor takes this count
    if args.device != "cpu":
        report = device_throughput(core, args)
        return _publish([json.dumps(report, indent=2)], report, args.json)
    engine = build_engine(
        core,
        EngineConfig(num_pages=4096, max_concurrency=256, async_output=_async_output(args), runtime=args.runtime),
    )
    tokenizer = core.tokenizer()
    gc.collect()
    gc.freeze()  # as `helios serve` does once started: the collector then skips what startup made
    bandwidth = measure_bandwidth()
    # What a decode step streams, as the engine holds the weights (upcast: fp32, twice the bytes).
    step_bytes = m.decode_weight_bytes * (2 if engine.upcast_from else 1)
    limit = step_bytes / bandwidth  # seconds per decode step at full read bandwidth
    if args.breakdown:
        parts = step_breakdown(engine, core, tokenizer, args.tokens, bandwidth, step_bytes)
        lines = [
            f"core {args.core}: {engine.executor.step_kind} step, linears on {engine.executor.linear_kernel}, "
            f"{parts['threads']} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s",
            f"one stream, median per decode step ({parts['tokens_per_step']} tokens a step): "
            f"{parts['step_ms']} ms = engine {parts['engine_ms']} (scheduling, sampling, bookkeeping) "
            f"+ inputs {parts['inputs_ms']} + step program {parts['program_ms']} "
            f"(back to back, no engine work between calls: {parts['program_back_to_back_ms']})",
            f"the linears alone ({parts['linear_mb']} MB) at one row: {parts['linears_ms']} ms; "
            f"the bandwidth limit of the {parts['decode_weight_mb']} MB a step reads: {parts['bandwidth_limit_ms']} ms",
        ]
        return _publish(lines, parts, args.json)
    params = recipe_sampling(core) if args.sampling == "recipe" else GREEDY
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        measured, cpu_ms = decode_run(engine, tokenizer, batch, args.tokens, params=params)
        flops = measure_flops(batch)
        step = max(limit, 2 * m.weights.num_parameters * batch / flops)
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": round(measured, 1),
                "bandwidth_limit_tokens_per_s": round(batch / limit, 1),
                "fraction_of_bandwidth_limit": round(measured * limit / batch, 3),
                "ceiling_tokens_per_s": round(batch / step, 1),
                "fraction_of_ceiling": round(measured * step / batch, 3),
                "matmul_gflops": round(flops / 1e9, 1),
                "cpu_ms_per_step": round(cpu_ms, 2),
            }
        )
    prefill = prefill_throughput(engine, tokenizer, args.prefill) if args.prefill else None
    report = {
        "core": str(args.core),
        "isa": cpu_isa.requested() or "native",
        "threads": torch.get_num_threads(),
        "linear_kernel": engine.executor.linear_kernel,
        "async_output": engine.async_output,
        "step": engine.executor.step_kind,
        "upcast_from": engine.upcast_from,
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "decode_weight_mb": round(step_bytes / 1e6, 1),
        "decode_limit_ms_per_token": round(limit * 1e3, 2),
        "sampling": args.sampling,
        "rows": rows,
        "prefill": prefill,
    }
    held = f"upcast from {engine.upcast_from} to float32" if engine.upcast_from else "as stored"
    lines = [
        f"core {args.core}: {report['step']} step, linears on {report['linear_kernel']}, weights {held}, "
        f"{report['threads']} threads, ISA {report['isa']}, {args.sampling} sampling",
        f"read bandwidth {report['bandwidth_gb_s']} GB/s; a decode step reads {report['decode_weight_mb']} MB: "
        f"limit {report['decode_limit_ms_per_token']} ms per step ({1 / limit:.1f} tok/s for one sequence)",
        f"{'batch':>5}  {'tok/s':>8}  {'bw limit':>8}  {'of limit':>8}  {'ceiling':>8}  {'fraction':>8}  {'GFLOP/s':>8}",
    ]
    columns = ("tokens_per_s", "bandwidth_limit_tokens_per_s", "fraction_of_bandwidth_limit", "ceiling_tokens_per_s")
    columns += ("fraction_of_ceiling", "matmul_gflops", "cpu_ms_per_step")
    lines[-1] += f"  {'CPU ms/step':>11}"
    lines += [f"{row['batch']:>5}  " + "  ".join(f"{row[name]:>8}" for name in columns) for row in rows]
    if prefill is not None:
        lines.append(
            f"prefill of {prefill['tokens']} tokens in {prefill['steps']} steps: {prefill['tokens_per_s']} tok/s "
            f"({prefill['seconds']} s, {prefill['cpu_seconds']} CPU s)"
        )
    _publish(lines, report, args.json)


def _publish(lines: list[str], report: dict, path: Path | None) -> None:
    """Print the report's lines, and write it as JSON to `path` when one is given."""
    for line in lines:
        print(line)
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
