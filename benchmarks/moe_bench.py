"""Routed-MoE step cost: does a decode step pay for the ACTIVE experts only?

    python benchmarks/moe_bench.py [--experts 64] [--hidden 512] [--moe-width 256] [--steps 20] [--threads N]
                                   [--reference-op] [--json out.json]

Writes a tiny random Qwen3-MoE checkpoint (2 layers, 64 experts), exports it twice with
ignition (top-2 routing, and top-64 = every expert on every token), loads each step
program the way helios' executor does (graph simplification, helios' CPU kernels, packed
linears) and times decode steps of 1 and 16 rows, each row one token of a sequence with
32 tokens of history. With routed execution, top-2 should cost a small fraction of
top-64; the expert weights dominate the model, so the ratio approaches 2/64 per row.
Set `--reference-op` to time the core's reference kernel instead of helios' kernel.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from helios.core import Core
from helios.core.program import Program, allocate_kv
from helios.engine import graph, prepack
from helios.engine.kernels import registry
from ignition.export import ExportOptions, export_core
from ignition.models import qwen3_moe
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

HISTORY = 32  # tokens already in each sequence's cache
# The plain Qwen3-MoE family's test recipe (the shipped qwen38 recipes are the hybrid qwen3_next family's).
RECIPE = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny_qwen3_moe.toml"


def write_checkpoint(out: Path, experts: int, top_k: int, hidden: int, moe_width: int) -> Path:
    """ignition's tiny Qwen3-MoE test checkpoint, resized: its tokenizer and template, new weights."""
    write_testmodel("qwen3_moe", out, seed=0)
    config = json.loads((out / "config.json").read_text())
    config |= {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "hidden_size": hidden,
        "moe_intermediate_size": moe_width,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": hidden // 8,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generator = torch.Generator().manual_seed(0)
    shapes = qwen3_moe.hf_shapes(qwen3_moe.config_from_hf(config))
    tensors = {
        name: (1.0 + 0.1 * torch.randn(shape, generator=generator))
        if len(shape) == 1
        else torch.randn(shape, generator=generator) / shape[1] ** 0.5
        for name, shape in shapes.items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load(core_dir: Path, reference_op: bool) -> tuple[Core, Program, dict[str, torch.Tensor]]:
    """The step program and weights as helios' CPU executor prepares them."""
    core = Core.open(core_dir)
    program = core.load_program(check_guards=False)
    weights = core.load_weights()
    if not reference_op:
        registry.register()
        graph.simplify(program)
    if prepack.available():
        weights = prepack.prepack([program], weights)
    return core, program, weights


def decode_inputs(rows: int, page_tokens: int, explicit: bool) -> dict[str, torch.Tensor]:
    """One decode token for each of `rows` sequences, sequence i on its own pages."""
    blocks = -(-(HISTORY + 1) // page_tokens)
    tables = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
    inputs = {
        "token_ids": torch.arange(rows) % 50 + 3,
        "positions": torch.full((rows,), HISTORY),
        "slot_mapping": tables[:, HISTORY // page_tokens].long() * page_tokens + HISTORY % page_tokens,
        "block_tables": tables,
        "seq_lens": torch.full((rows,), HISTORY + 1, dtype=torch.int32),
        "query_start_loc": torch.arange(rows + 1, dtype=torch.int32),
        "logits_indices": torch.arange(rows),
    }
    if explicit:
        inputs["logprob_token_ids"] = torch.zeros(rows, 1, dtype=torch.int64)
    return inputs


def step_ms(core: Core, program: Program, weights: dict[str, torch.Tensor], rows: int, steps: int) -> float:
    """Median wall time of one decode step of `rows` rows, in ms."""
    m = core.manifest
    blocks = -(-(HISTORY + 1) // m.limits.page_tokens)
    kv = allocate_kv(m.kv, rows * blocks, m.limits.page_tokens)
    inputs = decode_inputs(rows, m.limits.page_tokens, m.capabilities.explicit_logprob_ids)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        program(weights, kv, **inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reference-op", action="store_true", help="time the core's reference kernel, not helios'")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for top_k in (2, args.experts):
            checkpoint = write_checkpoint(Path(tmp) / f"ckpt-{top_k}", args.experts, top_k, args.hidden, args.moe_width)
            core_dir = Path(tmp) / f"core-{top_k}"
            export_core(open_source(str(checkpoint)), load_recipe(str(RECIPE)), ExportOptions(out=core_dir))
            core, program, weights = load(core_dir, args.reference_op)
            for rows in (1, 16):
                ms = step_ms(core, program, weights, rows, args.steps)
                results.append(
                    {"top_k": top_k, "rows": rows, "step_ms": round(ms, 2), "ms_per_token": round(ms / rows, 3)}
                )
                print(
                    f"top-{top_k:<3} of {args.experts} experts, {rows:>2} rows: step {ms:8.2f} ms, "
                    f"{ms / rows:7.3f} ms/token",
                    flush=True,
                )
    by = {(r["top_k"], r["rows"]): r["ms_per_token"] for r in results}
    for rows in (1, 16):
        print(
            f"{rows:>2} rows: top-2 costs {by[(2, rows)] / by[(args.experts, rows)]:.1%} of top-{args.experts} per token"
        )
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
