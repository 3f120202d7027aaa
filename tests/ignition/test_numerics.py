"""The SmolLM2 core's logprobs against Hugging Face transformers' LlamaForCausalLM.

transformers reads the same GGUF itself (its own dequantization and q/k un-permutation),
so this checks ignition's source reader and the exported program together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.program import run_prompt

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three primes."}],
    [
        {"role": "user", "content": "Write a haiku about rivers."},
        {"role": "assistant", "content": "Water finds its way"},
        {"role": "user", "content": "Another one, about stones."},
    ],
]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_hf))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf), dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "system", "multi-turn"])
def test_logprobs_match_transformers(smollm2_core: Path, hf_model, chat) -> None:
    tokenizer, model = hf_model
    core = Core.open(smollm2_core)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = run_prompt(
        core.load_program(), core.load_weights(), core.manifest.kv, core.manifest.limits.page_tokens, ids, chunk=16
    ).logprobs
    assert got.shape == reference.shape
    assert float((got - reference).abs().max()) <= 1e-3
