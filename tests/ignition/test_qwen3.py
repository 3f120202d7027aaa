"""The Qwen3 dense and Qwen3-MoE families: tiny checkpoints exported with the test recipes tests/data/tiny_qwen3*.toml,
checked against transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM, `ignition verify`,
and the Qwen3 special tokens and chat template the cores carry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.program import run_prompt
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core
from ignition.models import qwen3_moe
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import DATA, write_testmodel

RECIPES = {
    "qwen3": "tiny_qwen3",
    "qwen3_moe": "tiny_qwen3_moe",
}  # tests/data/NAME.toml (the qwen38 recipes are qwen3_next's)
RECIPE_DIR = Path(__file__).resolve().parents[1] / "data"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three primes."},
        {"role": "assistant", "content": "<think>\nSmall ones.\n</think>\n\n2, 3, 5"},
        {"role": "user", "content": "Now three squares, please."},
    ],
]


@pytest.fixture(scope="module", params=sorted(RECIPES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(family, tiny HF checkpoint, its core), built once per family for this module."""
    family = request.param
    checkpoint = write_testmodel(family, tmp_path_factory.mktemp("ckpt") / f"tiny-{family}", seed=3)
    core = tmp_path_factory.mktemp("cores") / f"tiny-{family}"
    export_core(
        open_source(str(checkpoint)), load_recipe(str(RECIPE_DIR / f"{RECIPES[family]}.toml")), ExportOptions(out=core)
    )
    return family, checkpoint, core


def _chat_ids(tokenizer, chat: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_match_transformers(exported: tuple[str, Path, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, checkpoint, core_dir = exported
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    core = Core.open(core_dir)
    assert core.manifest.model.family == family and core.manifest.recipe.name == RECIPES[family]
    program, weights, m = core.load_program(), core.load_weights(), core.manifest
    for chat in CHATS:
        ids = _chat_ids(tokenizer, chat)
        assert len(ids) > m.limits.page_tokens  # the 5-token chunks straddle KV pages
        got = run_prompt(program, weights, m.kv, m.limits.page_tokens, ids, chunk=5).logprobs
        reference = _hf_logprobs(model, ids)
        assert got.shape == reference.shape
        assert float((got - reference).abs().max()) <= 1e-4


def test_ignition_verify_passes(exported: tuple[str, Path, Path]) -> None:
    from typer.testing import CliRunner

    from ignition.cli import app

    done = CliRunner().invoke(app, ["verify", str(exported[2]), "--json"])  # in-process: no second torch start-up
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["ok"]


def test_core_carries_qwen3_tokens_and_template(exported: tuple[str, Path, Path]) -> None:
    core = Core.open(exported[2])
    specials = core.manifest.tokenizer.special_tokens
    tokenizer = core.tokenizer()
    for token in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert token in specials
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False).ids[1:-1] == [specials[token]]
    assert core.manifest.tokenizer.eos_token_ids == (specials["<|im_end|>"],)
    assert core.chat_template() == (DATA / "qwen3.jinja").read_text(encoding="utf-8")


def test_moe_reference_without_renormalization_matches_transformers(tmp_path: Path) -> None:
    """norm_topk_prob false (transformers' default): raw softmax weights of the top-k experts."""
    from transformers import AutoModelForCausalLM

    checkpoint = write_testmodel("qwen3_moe", tmp_path / "ckpt", seed=4)
    config = json.loads((checkpoint / "config.json").read_text())
    config["norm_topk_prob"] = False
    (checkpoint / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = list(range(3, 40))
    tensors = open_source(str(checkpoint)).tensors
    ours = torch.log_softmax(qwen3_moe.reference_logits(qwen3_moe.config_from_hf(config), tensors, ids), dim=-1)
    assert float((ours - _hf_logprobs(model, ids)).abs().max()) <= 1e-4


@pytest.mark.parametrize("layout", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}])
def test_moe_layouts_with_dense_layers_are_refused(layout: dict[str, object], tmp_path: Path) -> None:
    checkpoint = write_testmodel("qwen3_moe", tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text()) | layout
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match="only every-layer-sparse MoE is supported"):
        export_core(
            open_source(str(checkpoint)),
            load_recipe(str(RECIPE_DIR / "tiny_qwen3_moe.toml")),
            ExportOptions(out=tmp_path / "core"),
        )
    assert not (tmp_path / "core").exists()
