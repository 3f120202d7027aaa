"""16-bit cores: exported within their measured tolerance, served natively where the CPU has
fast 16-bit matmuls and upcast to fp32 at load where it does not, with the same answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine, precision
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source


@pytest.fixture(scope="module")
def bf16_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cores") / "tiny-bf16"
    result = export_core(
        open_source(str(tiny_checkpoint)), load_recipe("smollm2"), ExportOptions(out=out, dtype="bfloat16")
    )
    assert result.manifest.weights.dtype == "bfloat16" and result.manifest.kv.dtype == "bfloat16"
    return out


def _answer(core: Path) -> tuple[list[int], list[float], LLMEngine]:
    engine = build_engine(Core.open(core), EngineConfig(num_pages=64))
    request = EngineRequest("r", (5, 6, 7, 8, 9), (GREEDY,), 12, ignore_eos=True, num_top_logprobs=0)
    out = run_to_completion(engine, [request])["r"][0]
    return out.token_ids, [e.logprob for e in out.logprobs], engine


def test_a_host_without_native_bf16_upcasts_at_load(bf16_core: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "is_native", lambda dtype: True)
    native_tokens, native_logprobs, native = _answer(bf16_core)
    assert native.upcast_from is None and native.executor.kv[0].dtype.is_floating_point
    monkeypatch.setattr(precision, "is_native", lambda dtype: False)
    tokens, logprobs, upcast = _answer(bf16_core)
    assert upcast.upcast_from == "bfloat16" and str(upcast.executor.kv[0].dtype) == "torch.float32"
    assert all(str(w.dtype) == "torch.float32" for w in upcast.executor.weights.values() if w.is_floating_point())
    # fp32 arithmetic on the same bf16-rounded weights: at least as exact as the native path
    assert max(abs(a - b) for a, b in zip(logprobs, native_logprobs)) < 0.5
    assert len(tokens) == len(native_tokens) == 12


def test_kv_dtype_is_recorded_separately(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = export_core(
        open_source(str(tiny_checkpoint)),
        load_recipe("smollm2"),
        ExportOptions(out=tmp_path / "c", dtype="bfloat16", kv_dtype="float32"),
    )
    assert (result.manifest.weights.dtype, result.manifest.kv.dtype) == ("bfloat16", "float32")


def test_a_float32_core_with_a_bfloat16_cache_is_checked_at_the_cache_precision(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # float32's 1e-3 refused every such export (SmolLM2: 0.119 from the cache's rounding alone)
    result = export_core(
        open_source(str(tiny_checkpoint)),
        load_recipe("smollm2"),
        ExportOptions(out=tmp_path / "c", dtype="float32", kv_dtype="bfloat16"),
    )
    m = result.manifest
    assert (m.weights.dtype, m.kv.dtype, m.golden.tolerance) == ("float32", "bfloat16", 1.0)


@pytest.fixture(scope="module")
def bf16_compiled_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cores") / "tiny-bf16-compiled"
    options = ExportOptions(out=out, dtype="bfloat16", compile_step=True)
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), options)
    return out


@pytest.mark.parametrize("kind", ["portable", "compiled"])
def test_batching_invariance_in_bf16(
    kind: str, bf16_core: Path, bf16_compiled_core: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.engine.test_runtime import INVARIANCE_SETTINGS, PREAMBLE, _check_batching_invariance

    monkeypatch.setattr(precision, "is_native", lambda dtype: True)  # bf16 arithmetic even on a host without it
    core = Core.open(bf16_compiled_core if kind == "compiled" else bf16_core)
    # Not with 16-token prefill chunks: there bf16 parts from the answer alone at a near tie
    # (this random model's logits are nearly flat). Kernels block a chunk's rows differently
    # from a whole prompt's, and bf16 rounding of every matmul output turns those 1e-7
    # differences into 2^-9 steps (docs/export.md). Batched with others, prefix cache or not,
    # the answers are the same.
    _check_batching_invariance(core, 16, prefix=PREAMBLE, settings=INVARIANCE_SETTINGS[:2])


def test_the_native_matmul_answer_is_kept_per_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Measured once: a busy moment on a later start cannot flip a bf16 core to upcast."""
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    timings = iter([1.0, 3.0] * 3)  # bf16 rounds 3x faster than fp32 ones
    monkeypatch.setattr(precision, "_seconds", lambda dtype: next(timings))
    assert precision.is_native(torch.bfloat16) is True
    monkeypatch.setattr(precision, "_seconds", lambda dtype: 5.0 if dtype == torch.bfloat16 else 1.0)
    assert precision.is_native(torch.bfloat16) is True  # remembered, not measured again
