"""Quantized cores at load (helios.engine.quantized): the linears and expert stacks of a quantized
tiny llama and qwen3_moe core run on the quantized kernels (the native library's, or a plain-torch
stand-in with the same ops: tests/quant_support.py) or are dequantized at load (the fallback),
and either way the engine's logprobs equal those of the same core holding the dequantized weights."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from quant_support import dequantized_core, export_quantized, qlinear_ops
from safetensors.torch import load_file, save_file

from helios.core import Core, CoreError, quant
from helios.core import manifest as mf
from helios.core.golden import recheck
from helios.engine import EngineConfig, LLMEngine, build_engine, quantized, quantized_ref
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from helios.engine.speculation.drafter import SpeculationConfig
from ignition.export import ExportOptions, export_core
from ignition.quant_check import recorded_step
from ignition.quantize import QuantRequest
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.engine.quantized_checks import answers

DATA = Path(__file__).resolve().parents[1] / "data"
RECIPES = {"llama": "smollm2", "qwen3_moe": str(DATA / "tiny_qwen3_moe.toml")}
CASES = [("llama", "int8"), ("llama", "int4"), ("qwen3_moe", "int8"), ("qwen3_moe", "int4")]


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(family, format) -> (quantized core, its dequantized twin); float32 cores, groups of 32.
    The llama core's embedding table is quantized too (--quantize-embeddings): a use that is not a
    linear's (an embedding lookup)."""
    root = tmp_path_factory.mktemp("quantized")
    found = {}
    for family in RECIPES:
        checkpoint = write_testmodel(family, root / f"ckpt-{family}", seed=3)
        for fmt in quant.FORMATS:
            core = export_quantized(checkpoint, RECIPES[family], root / f"{family}-{fmt}", fmt, family == "llama")
            found[(family, fmt)] = (core, dequantized_core(core, root / f"{family}-{fmt}-twin"))
    return found


@pytest.fixture(scope="module")
def twin_answers(cores: dict) -> dict[tuple[str, str], dict]:
    """The twins' answers, each computed once (both paths compare with them)."""
    return {case: answers(_engine(twin)) for case, (_, twin) in cores.items()}


def _engine(core: Path, **config) -> LLMEngine:
    return build_engine(Core.open(core), EngineConfig(num_pages=96, **config))


def _assert_close(got: dict, want: dict, tolerance: float) -> None:
    for name, (tokens, logprobs) in want.items():
        assert got[name][0] == tokens, name
        assert max(abs(a - b) for a, b in zip(got[name][1], logprobs)) <= tolerance, name


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_fallback_dequantizes_and_matches_the_twin(
    cores: dict, twin_answers: dict, family: str, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, _ = cores[(family, fmt)]
    monkeypatch.setattr(quantized, "has_qlinear", lambda: False)
    engine = _engine(core)
    loaded = engine.executor.quantized
    assert loaded is not None and not loaded.native and loaded.dequantized
    assert loaded.reasons == ("no native quantized kernel here (flare_native::has_qlinear)",)
    assert engine.metrics().weights_in_memory == "float32"
    assert all(w.dtype == torch.float32 for w in engine.executor.weights.values() if w.is_floating_point())
    _assert_close(answers(engine), twin_answers[(family, fmt)], 1e-5)


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_native_path_runs_the_stored_values(cores: dict, twin_answers: dict, family: str, fmt: str) -> None:
    try:
        ops = qlinear_ops()
    except LookupError as exc:
        pytest.skip(str(exc))
    core, _ = cores[(family, fmt)]
    engine = _engine(core)
    loaded = engine.executor.quantized
    manifest = Core.open(core).manifest
    assert loaded is not None and set(loaded.native) | set(loaded.dequantized) == set(manifest.quantization.tensors)
    if family == "llama" and ops != "native":
        pytest.skip("the embedding lookup reads the native blob's layout, which the stand-in does not have")
    # Every quantized weight runs on its stored values; the llama core's embedding table (read by
    # aten.embedding) has its rows gathered from the packed blob (quantized.embedding_rows).
    assert loaded.dequantized == () and engine.metrics().weights_in_memory == f"{fmt}-g32"
    # No float copy of a natively run weight: the weights dict holds its packed bytes only.
    assert all(engine.executor.weights[name].dtype == torch.uint8 for name in loaded.native)
    assert any("w_experts" in name for name in loaded.native) == (family == "qwen3_moe")
    graph = engine.executor.step.module.graph
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.flare_native.qlinear.default) >= 4, ops
    assert calls.count(quantized.embedding_rows) == (family == "llama")
    if family == "qwen3_moe":
        from helios.engine.kernels import moe

        assert calls.count(moe.routed_experts_quantized) == 2
    _assert_close(answers(engine), twin_answers[(family, fmt)], 1e-4)


def test_prefix_cache_and_draft_core_keep_theanswers(cores: dict) -> None:
    """A quantized core reusing a cached prefix, and drafting with a quantized draft core (itself),
    answers as it does alone."""
    try:
        qlinear_ops()
    except LookupError as exc:
        pytest.skip(str(exc))
    core, _ = cores[("qwen3_moe", "int4")]
    plain = _engine(core)
    first = answers(plain)
    prompt = tuple(range(20, 60))  # past two pages of 16 tokens: the second run reuses them
    alone, again = (
        run_to_completion(plain, [EngineRequest("p", prompt, (GREEDY,), 8, ignore_eos=True, num_top_logprobs=3)])["p"][
            0
        ]
        for _ in range(2)
    )
    assert alone.num_cached_tokens == 0 and again.num_cached_tokens >= 32 and again.token_ids == alone.token_ids
    assert [e.logprob for e in again.logprobs] == [e.logprob for e in alone.logprobs]
    drafting = _engine(
        core,
        speculation=SpeculationConfig(mode="fixed", max_drafts=3, history=False),
        draft_core=Core.open(core),
    )
    assert drafting.executor.quantized is not None and drafting.learned is not None
    assert drafting.learned.executor.quantized is not None  # the draft core loads its own quantized weights
    _assert_close(answers(drafting), first, 1e-5)
    assert drafting.metrics().accepted_drafts > 0


def test_load_weights_dequantizes_in_name_order(cores: dict) -> None:
    core, twin = cores[("llama", "int4")]
    weights = Core.open(core).load_weights()
    assert list(weights) == sorted(weights) == sorted(Core.open(twin).load_weights())
    reference = load_file(str(twin / "weights.safetensors"))
    assert all(torch.equal(weights[name], reference[name]) for name in reference)


def test_a_device_other_than_the_cpu_dequantizes(cores: dict) -> None:
    core, _ = cores[("llama", "int8")]
    plain, stored = Core.open(core).load_stored()
    weights, loaded = quantized.prepare([], plain, stored, "cuda:0", False, "int8-g32")
    assert loaded is not None and loaded.native == () and "cuda:0" in loaded.reasons[0]
    assert list(weights) == sorted(weights) and all(weights[name].dtype == torch.float32 for name in stored)
    upcast, _ = quantized.prepare([], plain, stored, "cuda:0", True, "int8-g32")
    assert all(upcast[name].dtype == torch.float32 for name in stored)
    # the KV pool of a GPU is sized with the dequantized weights' bytes, not the file's
    growth = quantized.dequantized_growth(Core.open(core).manifest.quantization)
    assert growth == sum(weights[n].numel() * 4 for n in stored) - sum(
        sum(t.numel() * t.element_size() for t in (w.qweight, w.scales)) for w in stored.values()
    )


def test_a_missing_part_names_itself(cores: dict, tmp_path: Path) -> None:
    import shutil

    core, _ = cores[("llama", "int8")]
    broken = shutil.copytree(core, tmp_path / "broken")
    tensors = load_file(str(broken / "weights.safetensors"))
    del tensors["layers.0.wo.scales"]
    save_file(tensors, str(broken / "weights.safetensors"))
    with pytest.raises(CoreError, match=r"'layers\.0\.wo\.scales' is missing.*re-export"):
        Core.open(broken, verify_checksums=False).load_stored()


def _with_int8_activations(core: Path, out: Path) -> Path:
    """A copy of a quantized core whose 2-D weights are recorded with int8 activations (the tiny llama's
    embedding table, read only by its lookup, too: its rows come from the int8-activation blob)."""
    shutil.copytree(core, out)
    manifest = mf.decode((out / mf.MANIFEST_FILE).read_bytes())
    record = manifest.quantization
    tensors = {
        name: msgspec.structs.replace(t, activations=quant.INT8_ACTIVATIONS) if len(t.shape) == 2 else t
        for name, t in record.tensors.items()
    }
    quantization = msgspec.structs.replace(record, tensors=tensors)
    (out / mf.MANIFEST_FILE).write_bytes(mf.encode(msgspec.structs.replace(manifest, quantization=quantization)))
    return out


def test_int8_activations_run_as_recorded(cores: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice is the core's (manifest, per tensor): the native path packs those weights for the
    int8-activation kernel, the dequantizing fallback rounds the linears' inputs the same way
    (quantized_ref.fake_quantize), and both give the same answers."""
    core = _with_int8_activations(cores[("llama", "int4")][0], tmp_path / "a8")
    int8 = [n for n, t in Core.open(core).manifest.quantization.tensors.items() if t.activations == "int8"]
    with monkeypatch.context() as patched:
        patched.setattr(quantized, "has_qlinear", lambda: False)
        fallback = _engine(core)
        calls = [n.target for n in fallback.executor.step.module.graph.nodes if n.op == "call_function"]
        assert calls.count(quantized_ref.fake_quantize) == len(int8) - 1  # all but the embedding table
        want = answers(fallback)
    try:
        ops = qlinear_ops()
    except LookupError as exc:
        pytest.skip(str(exc))
    if ops != "native":
        pytest.skip("the stand-in has no int8-activation kernel")
    engine = _engine(core)
    loaded = engine.executor.quantized
    assert loaded is not None and loaded.dequantized == ()
    magic = {name: int(engine.executor.weights[name][:8].view(torch.int64)) for name in loaded.native}
    assert {magic[name] for name in int8} == {0x39514C46}  # "FLQ9": native/linear_qa.h's blob
    graph = engine.executor.step.module.graph
    assert [n.target for n in graph.nodes].count(quantized.embedding_rows) == 1  # rows from the FLQ8 blob
    _assert_close(answers(engine), want, 1e-4)


def test_verify_reruns_the_step_as_the_golden_values_were_recorded(cores: dict, tmp_path: Path) -> None:
    """`ignition verify` re-runs an int8-activation core's golden prompts with each such linear's
    input rounded as the export recorded them (quant_check.measure); a float-activation core's
    saved step runs as it is."""
    core = Core.open(_with_int8_activations(cores[("llama", "int4")][0], tmp_path / "a8"))
    int8 = [n for n, t in core.manifest.quantization.tensors.items() if t.activations == "int8"]
    program, weights = recorded_step(core)
    calls = [n.target for n in program.module.graph.nodes if n.op == "call_function"]
    assert calls.count(quantized_ref.fake_quantize) == len(int8) - 1  # all but the embedding table
    assert list(weights) == sorted(weights)
    plain, _ = recorded_step(Core.open(cores[("llama", "int4")][0]))
    assert quantized_ref.fake_quantize not in [n.target for n in plain.module.graph.nodes]


@pytest.mark.skipif(os.environ.get("FLARE_SLOW_TESTS") != "1", reason="one more export: FLARE_SLOW_TESTS=1")
def test_export_records_and_self_checks_int8_activations(tmp_path: Path) -> None:
    """`--quant-activations int8`: recorded per linear weight, in the level, and self-checked so (the
    recorded golden logprobs are the int8-activation run's: the engine reproduces them)."""
    checkpoint = write_testmodel("llama", tmp_path / "ckpt", seed=3)
    request = QuantRequest(quant.INT4, 32, activations=quant.INT8_ACTIVATIONS)
    options = ExportOptions(out=tmp_path / "core", quantization=request)
    export_core(open_source(str(checkpoint)), load_recipe("smollm2"), options)
    record = Core.open(tmp_path / "core").manifest.quantization
    assert record is not None and record.level == "int4-g32-a8" and record.self_check is not None
    assert {t.activations for t in record.tensors.values()} == {quant.INT8_ACTIVATIONS}
    assert record.self_check.top1_agreement > 0.5
    core = Core.open(tmp_path / "core")
    assert recheck(core, *recorded_step(core)) == 0.0  # as ignition verify runs it
