"""The CUDA path's correctness checks on a GPU (Flare issue 20), one JSON report.

    python benchmarks/cuda_check.py CORE [--device cuda] [--tokens 16] [--json out.json]

0. kernels: on CUDA, helios' Triton kernels fill every flare:: op's CUDA slot (devices.prepare);
1. runner: the core's step (loaded device-neutral, as the executor loads it) through helios.engine.graphs.GraphRunner with the real
   CudaGraphBackend: every decode bucket captured on padding (capture_all), then a 3-row decode
   step padded into bucket 4 against the eager unpadded step (max |d logits|), and no real KV
   slot written but the real rows' own;
2. logprobs: greedy generation of three prompts on the device (graphs on; the engine's startup,
   its probes and graph capture are stage "engine") against the CPU engine: the same tokens, and the chosen tokens' logprobs within 1e-3 (fp32 cores);
3. batching: each prompt alone and in a batch of 8 on the device with graphs on: the same tokens;
4. launches: graph replays happened (kind "graph" > 0) when graphs are on.

With --device cpu it runs the same code with the CPU test double (EagerBackend) instead of CUDA
graphs: a smoke test of this script, not of CUDA. Each stage runs on its own: one that raises is
reported in the JSON (its error and the last lines of its traceback, also on stderr) and the
others still run, where they do not need it. Exit status 1 when a check fails or a stage raises.
Written without a GPU at hand: not yet run on one.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helios.core import Core
from helios.core.ops.catalog import OPS
from helios.core.program import STEP, allocate_kv
from helios.engine import EngineConfig, LLMEngine, build_engine, devices, graph
from helios.engine.graphs import CudaGraphBackend, EagerBackend, GraphRunner
from helios.engine.kernels import registry
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


def stage(report: dict, name: str, run: Callable[[], Any]) -> Any:
    """run(), or None where it raised: then report[name] says what failed (and stderr the traceback)."""
    try:
        return run()
    except Exception as exc:
        lines = traceback.format_exc()
        print(f"cuda_check: {name} failed: {type(exc).__name__}: {exc}\n{lines}", file=sys.stderr, flush=True)
        report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": lines[-3000:]}
        return None


def checked(report: dict, name: str, run: Callable[[], dict | None]) -> None:
    """report[name] = run(), or what failed (stage)."""
    result = stage(report, name, run)
    if result is not None:
        report[name] = result


def kernels_check(device: str) -> dict:
    """The dispatcher's kernels for the device: on CUDA, every flare:: op's CUDA slot filled."""
    registry.register()
    devices.prepare(device)
    if not devices.is_cuda(device):
        return {"ok": True, "note": "CPU kernels"}
    kernels = [op for op, module in OPS.items() if module != "collectives"]  # those run on any device
    empty = [op for op in kernels if not torch._C._dispatch_has_kernel_for_dispatch_key(f"flare::{op}", "CUDA")]
    return {"ok": not empty, "ops_without_cuda_kernel": empty}


def runner_check(core: Core, device: str) -> dict:
    m = core.manifest
    program = core.load_program(STEP, check_guards=False)
    graph.place(program, device)  # as the executor loads it for the device
    weights = core.load_weights(device)
    page, pages = m.limits.page_tokens, 12
    generator = torch.Generator().manual_seed(0)
    filled = [
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype)).to(device)
        for t in allocate_kv(m.kv, pages + 1, page)
    ]
    for t in filled:
        t[pages].zero_()
    tables, lens, tokens = [[0, 1, 2], [5], [7, 3]], [2 * page + 3, 4, page + 1], [11, 12, 13]
    block = torch.zeros((3, 3), dtype=torch.int32)
    for row, table in enumerate(tables):
        block[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    positions = [n - 1 for n in lens]
    slots = [t[p // page] * page + p % page for t, p in zip(tables, positions)]
    inputs = {
        "token_ids": torch.tensor(tokens),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "block_tables": block,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.arange(4, dtype=torch.int32),
        "logits_indices": torch.arange(3),
    }
    explicit = "logprob_token_ids" in program.input_names
    if explicit:
        inputs["logprob_token_ids"] = torch.tensor([[1, 2], [3, 4], [5, 6]])
    inputs = {k: v.to(device) for k, v in inputs.items()}
    report: dict = {"eligible": GraphRunner.eligible(program.input_names)}
    if not report["eligible"]:
        return report | {"ok": True, "note": "this core's step runs eagerly (state slots or image inputs)"}
    eager_kv = [t.clone() for t in filled]
    expected = program(weights, eager_kv, **inputs)
    graph_kv = [t.clone() for t in filled]
    backend = CudaGraphBackend(device) if devices.is_cuda(device) else EagerBackend()
    runner = GraphRunner.for_core(m, program, weights, graph_kv, page, pages, device, backend)
    failure = runner.capture_all()
    report["capture"] = failure or f"captured {len(runner.buckets)} buckets"
    if failure is not None:
        return report | {"ok": False}
    got = runner.run(inputs)
    report["max_abs_logits_diff"] = float((got["logits"] - expected["logits"]).abs().max())
    untouched = torch.ones(pages * page, dtype=torch.bool, device=device)
    untouched[torch.tensor(slots, device=device)] = False
    clean = all(
        torch.equal(g[:pages].flatten(0, 1)[untouched], f[:pages].flatten(0, 1)[untouched])
        for g, f in zip(graph_kv, filled)
    )
    report["real_pages_untouched_by_padding"] = clean
    report["ok"] = clean and report["max_abs_logits_diff"] < 1e-4
    return report


def generate(engine: LLMEngine, prompts: list[tuple[int, ...]], tokens: int, tag: str) -> list[tuple[list, list]]:
    """Greedy tokens and their logprobs per prompt, all added at once."""
    for index, prompt in enumerate(prompts):
        engine.add(EngineRequest(f"{tag}-{index}", prompt, (GREEDY,), tokens, ignore_eos=True, num_top_logprobs=0))
    out = {f"{tag}-{i}": ([], []) for i in range(len(prompts))}
    while engine.has_work:
        for event in engine.step():
            ids, logprobs = out[event.request_id]
            ids += event.token_ids
            logprobs += [entry.logprob if entry is not None else None for entry in (event.logprobs or ())]
    return [out[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = args.device
    core = Core.open(args.core, verify_checksums=False)
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device, "gpu": None}
    if devices.is_cuda(device):
        checked(report, "gpu", lambda: {"name": torch.cuda.get_device_name(device), "triton": _triton_version()})
    checked(report, "kernels", lambda: kernels_check(device))
    checked(report, "runner", lambda: runner_check(core, device))
    tokenizer = core.tokenizer()
    prompts = [tuple(tokenizer.encode(p).ids) for p in PROMPTS]
    cpu = EngineConfig(num_pages=1024, max_concurrency=16, compiled_step=False)
    reference = stage(report, "cpu_reference", lambda: generate(build_engine(core, cpu), prompts, args.tokens, "cpu"))
    on = EngineConfig(num_pages=1024, max_concurrency=16, device=device, cuda_graphs=True)
    engine = stage(report, "engine", lambda: build_engine(core, on))  # the executor, startup probes, capture
    if engine is not None:
        report["cuda_graphs"] = engine.executor.graphs is not None
        on_device = stage(report, "logprobs", lambda: generate(engine, prompts, args.tokens, "dev"))
        if on_device is not None and reference is not None:
            report["logprobs"] = compare(reference, on_device)
        checked(report, "batching", lambda: batching(engine, tokenizer, prompts, args.tokens))
        report["launches"] = dict(engine.executor.launches)
        report["launches_ok"] = not devices.is_cuda(device) or report["launches"]["graph"] > 0
    checks = ("gpu", "kernels", "runner", "cpu_reference", "engine", "logprobs", "batching")
    failed = [name for name in checks if isinstance(report.get(name), dict) and not report[name].get("ok", True)]
    report["failed"] = failed + ([] if report.get("launches_ok") else ["launches"])
    report["ok"] = not report["failed"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["ok"] else 1


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def compare(reference: list[tuple[list, list]], on_device: list[tuple[list, list]]) -> dict:
    """The same greedy tokens, and their logprobs within 1e-3."""
    diffs = [
        max((abs(a - b) for a, b in zip(ref[1], dev[1]) if a is not None and b is not None), default=0.0)
        for ref, dev in zip(reference, on_device)
    ]
    same = [ref[0] == dev[0] for ref, dev in zip(reference, on_device)]
    return {"same_tokens": same, "max_abs_logprob_diff": diffs, "ok": all(same) and max(diffs) < 1e-3}


def batching(engine: LLMEngine, tokenizer, prompts: list[tuple[int, ...]], tokens: int) -> dict:
    """Each prompt alone and in a batch of 8: the same greedy tokens."""
    alone = [generate(engine, [p], tokens, f"alone{i}")[0][0] for i, p in enumerate(prompts)]
    batch = prompts + [tuple(tokenizer.encode(f"Filler request {i}: tell me about rivers.").ids) for i in range(5)]
    together = [ids for ids, _ in generate(engine, batch, tokens, "batch")[: len(prompts)]]
    same = [a == b for a, b in zip(alone, together)]
    return {"same_tokens_alone_and_in_8": same, "ok": all(same)}


if __name__ == "__main__":
    sys.exit(main())
