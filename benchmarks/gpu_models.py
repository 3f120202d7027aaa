"""The device check's models (benchmarks/gpu_check.sh): random-weight Llama checkpoints at real model
shapes exported as cores on the host that runs the check (nothing large is carried), and the same
checkpoints under plain transformers `generate`, the reference helios is measured against.

    python benchmarks/gpu_models.py cores OUT [--shapes tiny,smollm2,1b] [--small] [--json out.json]
    python benchmarks/gpu_models.py generate CHECKPOINT [--device cuda] [--dtype bfloat16]
        [--batches 1,32] [--tokens 64] [--json out.json]

cores: each shape lands in OUT/NAME/checkpoint (a Hugging Face checkpoint) and OUT/NAME/core.
  tiny     the llama family's tiny test model, fp32 (cuda_check.py's logprob comparison)
  smollm2  SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152, tied), bf16
  1b       Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads, vocab 128256, tied), bf16
The weights are random (the test model's init): throughput does not depend on them, and the
tokenizer is the test model's small one. --small shrinks the two large shapes to a few layers and a
smaller vocabulary, for a CPU smoke test of the device check.

generate: greedy decoding of `tokens` new tokens (EOS never ends a row early) for `batch` prompts
of 16 seeded random ids, with transformers' default cache and attention. Decode tokens/s, as
engine_bench.py counts them (prefill excluded): batch * (tokens - 1) / (time of generate(tokens)
- time of generate(1)), each the best of two runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

PROMPT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Shape:
    dtype: str
    overrides: dict[str, object]  # config.json fields over the llama test model's


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int) -> dict[str, object]:
    return {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    }


SHAPES = {
    "tiny": Shape("float32", {}),
    "smollm2": Shape("bfloat16", _llama(30, 576, 9, 3, 1536, 49152)),
    "1b": Shape("bfloat16", _llama(16, 2048, 32, 8, 8192, 128256)),
}
# --small: the same kinds of model, small enough to export and serve on a CPU in seconds.
SMALL = {
    "tiny": SHAPES["tiny"],
    "smollm2": Shape("bfloat16", _llama(4, 576, 9, 3, 1536, 49152)),
    "1b": Shape("bfloat16", _llama(2, 1024, 16, 4, 2048, 32768)),
}


def build(name: str, shape: Shape, out: Path) -> dict[str, object]:
    """Write the checkpoint and export its core (the smollm2 recipe: the llama family); returns timings."""
    started = time.perf_counter()
    checkpoint = write_testmodel("llama", out / "checkpoint", seed=0, overrides=dict(shape.overrides) or None)
    written = time.perf_counter()
    options = ExportOptions(out=out / "core", dtype=shape.dtype, force=True)
    m = export_core(open_source(str(checkpoint)), load_recipe("smollm2"), options).manifest
    return {
        "name": name,
        "dtype": shape.dtype,
        "checkpoint": str(checkpoint),
        "core": str(out / "core"),
        "parameters": m.weights.num_parameters,
        "decode_weight_bytes": m.decode_weight_bytes,
        "checkpoint_s": round(written - started, 1),
        "export_s": round(time.perf_counter() - written, 1),
    }


def _timed(model, ids: torch.Tensor, tokens: int) -> float:
    best = float("inf")
    for _ in range(2):
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        best = min(best, time.perf_counter() - start)
        assert out.shape[1] == ids.shape[1] + tokens, "generate stopped early"
    return best


def decode_rate(model, vocab: int, batch: int, tokens: int, device: str) -> dict:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, PROMPT_TOKENS), generator=generator).to(device)
    _timed(model, ids, 2)  # warm-up: kernels, allocator
    whole, first = _timed(model, ids, tokens), _timed(model, ids, 1)
    rate = batch * (tokens - 1) / max(whole - first, 1e-9)
    return {
        "batch": batch,
        "tokens": tokens,
        "tokens_per_s": round(rate, 1),
        "ms_per_step": round(1e3 * batch / rate, 3),
    }


def generate(args: argparse.Namespace) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(args.checkpoint), dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    vocab = int(model.config.vocab_size)
    with torch.inference_mode():
        rows = [decode_rate(model, vocab, int(b), args.tokens, args.device) for b in args.batches.split(",")]
    return {
        "checkpoint": str(args.checkpoint),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "dtype": args.dtype,
        "attention": getattr(model.config, "_attn_implementation", None),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cores = commands.add_parser("cores", help="write the checkpoints and export their cores")
    cores.add_argument("out", type=Path)
    cores.add_argument("--shapes", default="tiny,smollm2,1b")
    cores.add_argument("--small", action="store_true", help="small versions of the large shapes (CPU smoke test)")
    reference = commands.add_parser("generate", help="transformers generate's decode tokens/s on a checkpoint")
    reference.add_argument("checkpoint", type=Path)
    reference.add_argument("--device", default="cuda")
    reference.add_argument("--dtype", default="bfloat16")
    reference.add_argument("--batches", default="1,32")
    reference.add_argument("--tokens", type=int, default=64)
    for command in (cores, reference):
        command.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "cores":
        table = SMALL if args.small else SHAPES
        report: object = [build(name, table[name], args.out / name) for name in args.shapes.split(",")]
    else:
        report = generate(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
