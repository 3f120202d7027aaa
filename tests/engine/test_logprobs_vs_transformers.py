"""Engine logprobs on the SmolLM2 core against Hugging Face transformers on the same weights.

Generation logprobs (chosen + natural top-5), explicit-id logprobs and prompt logprobs
must all equal the raw distribution transformers computes, within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY

CHATS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nList three primes.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
]
EXPLICIT = (0, 2, 198, 504, 2)  # duplicates are the frontend's job; the engine reads what it is given


@pytest.fixture(scope="module")
def reference(smollm2_hf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_hf), dtype=torch.float32).eval()


@pytest.mark.parametrize("text", CHATS, ids=["chat", "system", "raw"])
def test_logprobs_equal_transformers(smollm2_core: Path, reference, text: str) -> None:
    core = Core.open(smollm2_core, verify_checksums=False)
    prompt = tuple(core.tokenizer().encode(text).ids)
    engine = build_engine(core, EngineConfig(num_pages=64, prefill_chunk_size=8))
    natural = EngineRequest("nat", prompt, (GREEDY,), 6, ignore_eos=True, num_top_logprobs=5, prompt_logprobs=5)
    explicit = EngineRequest(
        "exp",
        prompt,
        (GREEDY,),
        6,
        ignore_eos=True,
        num_top_logprobs=0,
        logprob_token_ids=tuple(dict.fromkeys(EXPLICIT)),
    )
    out = run_to_completion(engine, [natural, explicit])
    generated = out["nat"][0].token_ids
    assert out["exp"][0].token_ids == generated
    with torch.no_grad():
        full = torch.tensor([list(prompt) + generated])
        logprobs = torch.log_softmax(reference(full).logits[0].float(), dim=-1)  # [T, V]
    for step, entry in enumerate(out["nat"][0].logprobs):
        row = logprobs[len(prompt) - 1 + step]
        assert abs(entry.logprob - float(row[entry.token_id])) <= 1e-3
        top = torch.topk(row, 5)
        assert [tid for tid, _ in entry.alternatives] == top.indices.tolist()
        assert max(abs(v - float(row[t])) for t, v in entry.alternatives) <= 1e-3
    for step, entry in enumerate(out["exp"][0].logprobs):
        row = logprobs[len(prompt) - 1 + step]
        ids = [tid for tid, _ in entry.alternatives]
        assert ids[: len(set(EXPLICIT))] == list(dict.fromkeys(EXPLICIT))
        assert max(abs(v - float(row[t])) for t, v in entry.alternatives) <= 1e-3
    scored = out["nat"][0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompt)
    for position in range(1, len(prompt)):
        row = logprobs[position - 1]
        actual = prompt[position]
        entry = scored[position]
        assert abs(entry[actual].logprob - float(row[actual])) <= 1e-3
        assert entry[actual].rank == int((row > row[actual]).sum()) + 1
        top = torch.topk(row, 5).indices.tolist()
        assert set(top) <= set(entry)
