"""Source readers: the HF cache resolves offline, GGUF tokenizers match Hugging Face's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import run_cli
from tokenizers import Tokenizer

from helios.core import Core
from ignition.errors import ExitCode
from ignition.sources.gguf_source import _metadata
from ignition.sources.tokenizer_gguf import tokenizer_from_gguf


def _fake_hf_cache(root: Path, repo: str, checkpoint: Path) -> Path:
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    snapshot = base / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoint, snapshot)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(snapshot.name)
    return root


def test_repo_id_from_local_hf_cache(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cache = _fake_hf_cache(tmp_path / "hub", "flare-tests/tiny-llama", tiny_checkpoint)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "core"
    done = run_cli("ignition", "export", "flare-tests/tiny-llama", "--recipe", "smollm2", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr
    model = Core.open(out).manifest.model
    assert model.id == "flare-tests/tiny-llama" and model.source.kind == "hf-cache"
    assert set(model.source.files) >= {"config.json", "model.safetensors", "tokenizer.json"}
    missing = run_cli(
        "ignition", "export", "flare-tests/absent", "--recipe", "smollm2", "--out", str(tmp_path / "x"), env=env
    )
    assert missing.returncode == ExitCode.SOURCE and "local Hugging Face cache" in missing.stderr


@pytest.fixture(scope="module")
def gguf_tokenizers(smollm2_gguf: Path) -> tuple[Tokenizer, object]:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    ours = tokenizer_from_gguf(_metadata(GGUFReader(str(smollm2_gguf))))
    theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return ours, theirs


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "Prices rose 12345 points in 2024, didn't they?",
        "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "  indented\tcode = {'a': [1, 2]}\n\n",
        "naïve café — 東京 🚀",
    ],
)
def test_gguf_tokenizer_matches_transformers(gguf_tokenizers, text: str) -> None:
    ours, theirs = gguf_tokenizers
    ids = ours.encode(text).ids
    assert ids == theirs(text, add_special_tokens=True)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm2_core_tokenizer_facts(smollm2_core: Path) -> None:
    m = Core.open(smollm2_core).manifest
    assert m.model.id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert m.tokenizer.vocab_size == 49152 and m.tokenizer.eos_token_ids == (2,)
    assert m.limits.max_model_len == 8192 and m.kv.num_layers == 30 and m.kv.num_kv_heads == 3
    assert m.model.source.kind == "gguf" and len(next(iter(m.model.source.files.values()))) == 64
    assert json.loads((smollm2_core / "tokenizer.json").read_text())["model"]["type"] == "BPE"
