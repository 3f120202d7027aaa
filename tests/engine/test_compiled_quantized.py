"""The compiled step of a quantized core (ignition export --quantize ... --compile-step).

Fast: the flare_quant:: ops a compiled quantized step calls (its expert stacks and embedding
rows) pass torch's op checks (schema, fake kernel, dispatch) on packed blobs and equal the
portable step's Python kernels. Slow (FLARE_SLOW_TESTS=1, an AOTInductor build per core, about
a minute each on 2 cores): tiny llama (int4, embedding table quantized too; int8 and int4 on int8
activations) and qwen3_moe (int8) cores exported with the compiled step hold only the packed blobs
of their quantized weights, load and serve it, and answer as the portable quantized step does:
the same greedy tokens, logprobs within the export's self-check tolerance.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helios.core import Core, quant
from helios.core.program import STEP
from helios.engine import EngineConfig, build_engine, native, quantized, quantized_ops
from helios.engine.kernels import moe
from ignition.errors import UsageError
from ignition.export import ExportOptions, export_core
from ignition.quantize import QuantRequest
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.engine.quantized_checks import answers

DATA = Path(__file__).resolve().parents[1] / "data"
# What AOTInductor relies on: the schema, and fake kernels agreeing with the real ones (opcheck's
# autograd checks compile with aot_autograd: minutes on a busy 2-core host, and nothing here
# takes gradients).
CHECKS = ("test_schema", "test_faketensor")


def _native_or_skip() -> None:
    if not native.load() or not quantized.has_qlinear():
        pytest.skip("no native quantized kernels on this host (flare_native::has_qlinear)")


def _packed(shape: tuple[int, ...], fmt: str, seed: int) -> torch.Tensor:
    """A random weight of `shape` quantized (groups of 32) and packed as helios packs it at load."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    parts = quant.quantize(w, fmt, 32, torch.float32)
    return torch.ops.flare_native.pack_qlinear(parts[quant.QWEIGHT], parts[quant.SCALES], parts.get(quant.MINS), 32)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_the_ops_pass_torch_checks_and_equal_the_portable_kernels(fmt: str) -> None:
    _native_or_skip()
    table = _packed((40, 64), fmt, 0)
    ids = torch.tensor([[0, 17], [39, 16]])
    torch.library.opcheck(quantized_ops.EMBEDDING_ROWS, (table, ids, torch.float32, 64), test_utils=CHECKS)
    assert torch.equal(
        quantized_ops.EMBEDDING_ROWS(table, ids, torch.float32, 64), quantized.embedding_rows(table, ids, torch.float32)
    )
    # a tied table packed for int8 activations: a compiled step reads its rows natively
    parts = quant.quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(4)), fmt, 32, torch.float32)
    a8 = torch.ops.flare_native.pack_qlinear(parts[quant.QWEIGHT], parts[quant.SCALES], parts.get(quant.MINS), 32, 8)
    op = torch.ops.flare_native.qembedding_a8.default
    torch.library.opcheck(op, (a8, ids, torch.bfloat16, 64), test_utils=CHECKS)
    assert torch.equal(op(a8, ids, torch.bfloat16, 64), quantized.embedding_rows(a8, ids, torch.bfloat16))
    experts, hidden, features, tokens = 4, 64, 32, 5
    gate_up = torch.stack([_packed((2 * features, hidden), fmt, 1 + e) for e in range(experts)])
    down = torch.stack([_packed((hidden, features), fmt, 9 + e) for e in range(experts)])
    h = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(3))
    for ids in (torch.tensor([[0, 3]] * tokens), torch.tensor([[1, 2], [3, 0], [2, 2], [0, 1], [3, 1]])):
        args = (h, weights, ids, gate_up, down, "silu", 0.0, 1.0, None, 1e-6, torch.float32, 2 * features, hidden)
        torch.library.opcheck(quantized_ops.ROUTED_EXPERTS, args, test_utils=CHECKS)
        want = moe.routed_experts_quantized(
            *args[:10], dtype=torch.float32, gate_up_features=2 * features, down_features=hidden
        )
        assert torch.equal(quantized_ops.ROUTED_EXPERTS(*args), want)


# ---------------------------------------------------------------------------- exported and served

slow = pytest.mark.skipif(
    os.environ.get("FLARE_SLOW_TESTS") != "1",
    reason="AOTInductor builds of quantized steps run only with FLARE_SLOW_TESTS=1 (about a minute each on 2 cores)",
)
# name -> (family, recipe, format, quantize the embedding table too, activations)
CASES = {
    "llama-int4": ("llama", "smollm2", quant.INT4, True, quant.FLOAT_ACTIVATIONS),
    "llama-int8-a8": ("llama", "smollm2", quant.INT8, False, quant.INT8_ACTIVATIONS),
    "llama-int4-a8": ("llama", "smollm2", quant.INT4, True, quant.INT8_ACTIVATIONS),
    "qwen3_moe-int8": ("qwen3_moe", str(DATA / "tiny_qwen3_moe.toml"), quant.INT8, False, quant.FLOAT_ACTIVATIONS),
}


@pytest.fixture(scope="module")
def compiled_cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    _native_or_skip()
    root = tmp_path_factory.mktemp("compiled-quantized")
    cores = {}
    for name, (family, recipe, fmt, embeddings, activations) in CASES.items():
        checkpoint = root / f"ckpt-{family}"
        if not checkpoint.exists():
            write_testmodel(family, checkpoint, seed=3)
        request = QuantRequest(fmt, 32, embeddings=embeddings, activations=activations)
        options = ExportOptions(out=root / name, quantization=request, compile_step=True)
        export_core(open_source(str(checkpoint)), load_recipe(recipe), options)
        cores[name] = root / name
    return cores


@slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_compiled_step_serves_as_the_portable_one(compiled_cores: dict[str, Path], name: str) -> None:
    core = Core.open(compiled_cores[name])
    manifest = core.manifest
    assert manifest.quantization is not None
    spec = manifest.compiled[STEP]
    # int8 activations: the compiled step may also stray by what rounding them moves (bounded here by
    # the self-check's distance from the unquantized weights, which includes it; docs/quantization.md)
    a8 = CASES[name][4] == quant.INT8_ACTIVATIONS
    bound = manifest.golden.tolerance + (manifest.quantization.self_check.max_abs_logprob_diff if a8 else 0.0)
    assert spec.max_abs_diff <= bound
    # The package holds each quantized weight as its packed blob (its constant w<i> is the i-th
    # weight of the step's weights dict) and no float constant larger than the float weights.
    plain, stored = core.load_stored()
    names = sorted({*plain, *stored})
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(core.root / spec.file), 1)
    constants = runner.extract_constants_map(False)
    # (a float weight may be held prepacked for the native linears: outputs in blocks of 16, inputs in pairs)
    largest = max(
        -(-w.shape[0] // 16) * 16 * -(-w[0].numel() // 2) * 2 for w in plain.values() if w.is_floating_point()
    )
    blobs = 0
    for key, value in constants.items():
        if key.startswith("w") and names[int(key[1:])] in stored:
            assert value.dtype == torch.uint8, key
            blobs += 1
        else:
            assert not value.is_floating_point() or value.numel() <= largest, key
    assert blobs == len(stored)  # every quantized weight of these cores is read by the step
    compiled = build_engine(core, EngineConfig(num_pages=96))
    portable = build_engine(core, EngineConfig(num_pages=96, compiled_step=False))
    assert compiled.executor.step_kind == "compiled" and portable.executor.step_kind == "portable"
    level = manifest.quantization.level
    assert compiled.metrics().weights_in_memory == level == portable.metrics().weights_in_memory
    assert compiled.executor.weights == {}  # the package carries the weights
    got, want = answers(compiled), answers(portable)
    for request, (tokens, logprobs) in want.items():
        assert got[request][0] == tokens, request
        assert max(abs(a - b) for a, b in zip(got[request][1], logprobs)) <= bound, request


@slow
def test_an_export_that_would_dequantize_into_the_package_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the native quantized kernels the step would hold float copies: export says so."""
    monkeypatch.setattr(quantized, "has_qlinear", lambda: False)
    checkpoint = write_testmodel("llama", tmp_path / "ckpt", seed=3)
    options = ExportOptions(out=tmp_path / "core", quantization=QuantRequest(quant.INT8), compile_step=True)
    with pytest.raises(UsageError, match="would be dequantized into the package"):
        export_core(open_source(str(checkpoint)), load_recipe("smollm2"), options)
    assert not (tmp_path / "core").exists()
