"""helios' AVX2 linear (helios/engine/native/linear_avx2.cpp) on bfloat16 and float32 weights: the
portable fast path of every x86-64 CPU with AVX2 and FMA, compiled into the library on any x86 host
(an AVX-512 one too).

Against a float64 reference on random shapes (odd sizes, 1-64 rows, with and without bias), the
same bits for a row whatever rows and threads share its call, a bfloat16 core served on it (bf16
weights kept, no upcast; reproducible answers; logits within bfloat16 rounding of fp32's) and an
fp32 core's programs, portable and compiled, on it."""

from __future__ import annotations

import platform
from pathlib import Path

import msgspec
import pytest
import torch

from helios import cpu_isa
from helios.core import Core
from helios.core.program import STEP, run_prompt
from helios.engine import EngineConfig, build_engine, graph, native, precision, prepack
from helios.engine.offline import run_to_completion
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.engine.test_reproducible import check_reproducible
from tests.engine.test_runtime import _requests

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not (native.load() and prepack.avx2_available()),
    reason="not an x86-64 CPU with AVX2 and FMA, or no C++ compiler for helios' native kernels",
)

BF16_STEP = 2.0**-7  # relative spacing of bfloat16 (8 significant bits): rounding moves half of it at most


def _case(n: int, k: int, rows: int, bias: bool, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator).to(dtype)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    return w, x, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product in float64, and the scale of its rounding error (sum of |terms|)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
    return exact, scale


SHAPES = [(1, 1), (5, 3), (17, 33), (31, 64), (47, 129), (100, 577), (192, 576), (576, 1535)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(n: int, k: int, bias: bool) -> None:
    w, x, b = _case(n, k, 64, bias, seed=n * 1000 + k)
    packed = torch.ops.flare_native.pack_linear(w)
    for rows in (1, 2, 3, 4, 5, 8, 13, 32, 64):
        y = torch.ops.flare_native.linear_avx2(x[:rows], packed, b, n)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        exact, scale = _reference(x[:rows], w, b)
        # bf16 rounding of the result, plus fp32 accumulation over k terms
        bound = BF16_STEP / 2 * exact.abs() + k * 2.0**-24 * scale + 1e-30
        assert bool(((y.double() - exact).abs() <= bound).all()), f"{rows} rows"
        # fp32 activations: the same sums, unrounded
        y32 = torch.ops.flare_native.linear_avx2(x[:rows].float(), packed, b, n)
        assert y32.dtype == torch.float32
        assert bool(((y32.double() - exact).abs() <= k * 2.0**-24 * scale + 1e-30).all())
        assert torch.equal(y32.to(torch.bfloat16), y)  # bf16 outputs are the fp32 sums, rounded


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_weights_match_the_reference(n: int, k: int, bias: bool) -> None:
    """An fp32 core's weights, packed [blocks, pairs, 2, 16] and loaded as they are."""
    w, x, b = _case(n, k, 64, bias, seed=n * 1000 + k + 1, dtype=torch.float32)
    packed = torch.ops.flare_native.pack_linear(w)
    assert packed.dtype == torch.float32 and packed.shape[2:] == (2, 16)
    for rows in (1, 2, 3, 4, 5, 6, 8, 13, 32, 64):
        y = torch.ops.flare_native.linear_avx2(x[:rows], packed, b, n)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        exact, scale = _reference(x[:rows], w, b)
        assert bool(((y.double() - exact).abs() <= k * 2.0**-24 * scale + 1e-30).all()), f"{rows} rows"
        # bf16 activations on fp32 weights: the same sums, rounded to bf16
        y16 = torch.ops.flare_native.linear_avx2(x[:rows].to(torch.bfloat16), packed, b, n)
        wide = torch.ops.flare_native.linear_avx2(x[:rows].to(torch.bfloat16).float(), packed, b, n)
        assert y16.dtype == torch.bfloat16 and torch.equal(y16, wide.to(torch.bfloat16))


def test_outputs_round_to_nearest_even_as_torch() -> None:
    """With an identity weight each output is an input feature plus a bias: the fp32 sum rounded
    as torch rounds it (nearest, ties to even; NaN stays NaN)."""
    k = 48
    w = torch.eye(k).to(torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    bias = torch.randn(k) * 1e-3  # fp32 bias: sums that are not bfloat16 values
    bias[5] = float("nan")
    y = torch.ops.flare_native.linear_avx2(x, torch.ops.flare_native.pack_linear(w), bias, k)
    expected = (x.float() + bias).to(torch.bfloat16)
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(33, 63), (576, 576), (1536, 577)])
def test_a_row_has_the_same_bits_alone_among_others_and_on_any_thread_count(n: int, k: int, dtype) -> None:
    w, x, b = _case(n, k, 64, True, seed=7, dtype=dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    packed = torch.ops.flare_native.pack_linear(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [torch.ops.flare_native.linear_avx2(x[i : i + 1], packed, b, n) for i in range(64)]
        for threads in {1, 2, before}:
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 5, 7, 8, 16, 33, 64):
                y = torch.ops.flare_native.linear_avx2(x[:rows], packed, b, n)
                for i in range(rows):
                    assert torch.equal(y[i].view(bits), alone[i][0].view(bits)), (threads, rows, i)
    finally:
        torch.set_num_threads(before)


def test_shapes_and_checks() -> None:
    w = torch.randn(40, 9).to(torch.bfloat16)
    packed = torch.ops.flare_native.pack_linear(w)
    assert packed.shape == (3, 5, 16, 2)  # 40 outputs in 3 blocks of 16, 9 features in 5 pairs
    x = torch.randn(2, 3, 9).to(torch.bfloat16)
    assert torch.ops.flare_native.linear_avx2(x, packed, None, 40).shape == (2, 3, 40)
    assert torch.ops.flare_native.linear_avx2(x[:0], packed, None, 40).shape == (0, 3, 40)
    meta = torch.ops.flare_native.linear_avx2(x.to("meta"), packed.to("meta"), None, 40)
    assert meta.shape == (2, 3, 40) and meta.device.type == "meta"
    with pytest.raises(RuntimeError, match="input size"):
        torch.ops.flare_native.linear_avx2(torch.randn(1, 8).to(torch.bfloat16), packed, None, 40)
    with pytest.raises(RuntimeError, match="even"):  # the AVX512-BF16 kernel reads whole pairs
        torch.ops.flare_native.linear(x, packed, None, 40)
    assert prepack.takes(prepack.NATIVE_AVX2, w) and not prepack.takes(prepack.NATIVE, w)
    w32 = torch.randn(40, 9)
    packed32 = torch.ops.flare_native.pack_linear(w32)
    assert packed32.shape == (3, 5, 2, 16)  # the pair's two features apart, 16 outputs each
    assert torch.equal(packed32[1, 2, 1, :8], w32[16:24, 5])  # block 1, pair 2's odd feature (5)
    assert float(packed32[2, 4, 1].abs().sum()) == 0.0  # the padded tenth feature
    with pytest.raises(RuntimeError, match="float32 ones run on linear_avx2"):
        torch.ops.flare_native.linear(
            torch.randn(1, 10), torch.ops.flare_native.pack_linear(torch.randn(40, 10)), None, 40
        )
    with pytest.raises(RuntimeError, match="pack_linear"):
        torch.ops.flare_native.pack_linear(torch.randn(40, 10).half())
    assert prepack.takes(prepack.NATIVE_AVX2, w32) and not prepack.takes(prepack.NATIVE, w32)


def test_emulating_an_avx2_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLARE_CPU_ISA=avx2: flags, fingerprints and the library's key lose AVX-512; torch is told too."""
    from helios.core import host

    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "avx_vnni"})
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    assert cpu_isa.visible_flags(flags) == {"avx2", "fma", "f16c"}
    assert not any(f.startswith("avx512") for f in host.fingerprint().isa)
    assert native._march() == "-march=haswell"
    emulated = native.library_path()
    assert cpu_isa.torch_environment() == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "TORCHINDUCTOR_CPP_MARCH": "haswell",
    }
    monkeypatch.setenv(cpu_isa.ENV, "native")
    assert cpu_isa.visible_flags(flags) == flags and native._march() == "-march=native"
    assert native.library_path() != emulated
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    with pytest.raises(ValueError, match="emulates only"):
        cpu_isa.requested()


@pytest.mark.parametrize(
    ("avx2_ms", "keeps_bf16"),
    [
        ({1: 5.0, 32: 40.0}, True),  # half the bytes at one row, as fast at 32
        ({1: 5.0, 32: 48.0}, True),  # at most 25% slower at 32 rows still keeps them
        ({1: 5.0, 32: 60.0}, False),  # much slower at many rows: upcast
        ({1: 9.5, 32: 40.0}, False),  # not faster at one row: upcast
    ],
)
def test_a_bf16_core_is_upcast_only_where_no_bf16_kernel_is_competitive(
    avx2_ms: dict[int, float], keeps_bf16: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As on an AVX2 host: oneDNN's bf16 is slow there, so helios' AVX2 kernel decides, against fp32
    oneDNN (10 ms at one row, 40 at 32), measured once and remembered."""
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precision, "_onednn_native", lambda dtype: False)
    monkeypatch.setattr(prepack, "native_kernels", lambda: [prepack.NATIVE_AVX2])
    timings = {prepack.ONEDNN: {1: 10.0, 32: 40.0}, prepack.NATIVE_AVX2: avx2_ms}
    monkeypatch.setattr(precision, "_streamed_ms", lambda kernel, weights: timings[kernel])
    monkeypatch.setattr(precision, "_STREAM_BYTES", 1)  # (the patched timings need no weights)
    assert precision.is_native(torch.bfloat16) is keeps_bf16
    monkeypatch.setattr(precision, "_streamed_ms", lambda kernel, weights: pytest.fail("measured again"))
    assert precision.is_native(torch.bfloat16) is keeps_bf16


def test_where_onednn_cannot_pack_bf16_the_avx2_kernel_runs_unmeasured(
    bf16_core: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """oneDNN packs bf16 weights only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: on an AVX2 host the
    AVX2 kernel is the one candidate, and a oneDNN rewrite leaves bf16 linears unpacked."""
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prepack, "onednn_bf16", lambda: False)
    monkeypatch.setattr(prepack, "native_kernels", lambda: [prepack.NATIVE_AVX2])
    monkeypatch.setattr(prepack, "_measure", lambda *args: pytest.fail("measured"))
    core = Core.open(bf16_core)
    program = core.load_program(STEP, check_guards=False)
    weights = core.load_weights("cpu")
    assert prepack.choose([program], weights) == prepack.NATIVE_AVX2
    assert prepack.prepack([program], weights, prepack.ONEDNN) is weights  # nothing packed, nothing fails


# ------------------------------------------------------------------------------ a core served on it


@pytest.fixture(scope="module")
def bf16_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cores") / "tiny-bf16-avx2"
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), ExportOptions(out=out, dtype="bfloat16"))
    return out


@pytest.fixture
def avx2_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 kernel forced (the test hook FLARE_LINEAR_KERNEL), as an AVX2 host measures it."""
    monkeypatch.setenv("FLARE_LINEAR_KERNEL", prepack.NATIVE_AVX2)


@pytest.mark.usefixtures("avx2_kernel")
def test_a_bf16_core_keeps_bf16_weights_on_it(bf16_core: Path) -> None:
    assert precision.is_native(torch.bfloat16)  # no measurement: the forced kernel is a bf16 one
    engine = build_engine(Core.open(bf16_core), EngineConfig(num_pages=64))
    executor = engine.executor
    assert engine.upcast_from is None and executor.linear_kernel == prepack.NATIVE_AVX2
    assert executor.kv[0].dtype == torch.bfloat16
    matrices = [w for w in executor.weights.values() if w.dim() >= 2]
    assert matrices and all(w.dtype == torch.bfloat16 for w in matrices)
    targets = {n.target for n in executor.step.module.graph.nodes if n.op == "call_function"}
    assert torch.ops.flare_native.linear_avx2.default in targets


@pytest.mark.usefixtures("avx2_kernel")
def test_answers_on_it_are_reproducible(bf16_core: Path, tmp_path: Path) -> None:
    """Alone, among 16 others, cold in chunks of 7, with speculation, after a host-store restart."""
    check_reproducible(Core.open(bf16_core), 16, (16,), tmp_path)


@pytest.fixture(scope="module")
def compiled_avx2_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 tiny core whose compiled step export built on the AVX2 kernel (as an AVX2 host's
    export measures it)."""
    out = tmp_path_factory.mktemp("cores") / "tiny-bf16-avx2-compiled"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLARE_LINEAR_KERNEL", prepack.NATIVE_AVX2)
        export_core(
            open_source(str(tiny_checkpoint)),
            load_recipe("smollm2"),
            ExportOptions(out=out, dtype="bfloat16", compile_step=True),
        )
    return out


@pytest.mark.usefixtures("avx2_kernel")
def test_a_compiled_step_runs_on_it(compiled_avx2_core: Path) -> None:
    """AVX2 hosts get the compiled step too (no upcast, so the executor takes it): the package
    calls flare_native::linear_avx2 on its packed constants."""
    core = Core.open(compiled_avx2_core)
    spec = core.manifest.compiled[STEP]
    assert '"flare_native::linear_avx2"' in (compiled_avx2_core / spec.file).with_suffix(".json").read_text()
    assert spec.max_abs_diff <= core.manifest.golden.tolerance  # export's self-check against the portable step
    engine = build_engine(core, EngineConfig(num_pages=64))
    assert engine.executor.step_kind == "compiled" and engine.executor.linear_kernel == prepack.NATIVE_AVX2
    out = run_to_completion(engine, _requests(core, 6))
    assert all(len(choices[0].token_ids) == 6 for choices in out.values())


def test_logits_on_it_match_fp32_within_bf16_rounding(bf16_core: Path) -> None:
    """The same bf16 weights run in fp32 throughout (the upcast program) as the reference: the bf16
    program on the AVX2 kernel rounds every activation to bf16, so its logprobs drift by bf16 steps."""
    core = Core.open(bf16_core)
    prompt = list(range(3, 40))
    m = core.manifest
    program = core.load_program(STEP, check_guards=False)
    weights = prepack.prepack([program], core.load_weights("cpu"), prepack.NATIVE_AVX2)
    assert any(n.target == torch.ops.flare_native.linear_avx2.default for n in program.module.graph.nodes)
    avx2 = run_prompt(program, weights, m.kv, m.limits.page_tokens, prompt, chunk=7).logprobs
    again = run_prompt(program, weights, m.kv, m.limits.page_tokens, prompt, chunk=5).logprobs
    assert torch.equal(avx2, again)  # prefill chunking does not change a row's bits
    reference = core.load_program(STEP, check_guards=False)
    graph.upcast(reference)
    graph.simplify(reference)  # as the executor loads an upcast core (drops the bf16 metadata asserts)
    full = {name: w.float() if w.is_floating_point() else w for name, w in core.load_weights("cpu").items()}
    fp32 = run_prompt(
        reference, full, msgspec.structs.replace(m.kv, dtype="float32"), m.limits.page_tokens, prompt, chunk=7
    ).logprobs
    assert float((avx2 - fp32).abs().max()) < 0.1


# ------------------------------------------------------------------------------ an fp32 core on it


def test_an_fp32_cores_linears_run_on_it(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The portable fp32 step on the AVX2 kernel: logprobs within fp32 rounding of oneDNN's, and the
    same bits whatever the prefill chunking."""
    out = tmp_path_factory.mktemp("cores") / "tiny-fp32"
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), ExportOptions(out=out, dtype="float32"))
    core = Core.open(out)
    m = core.manifest
    prompt = list(range(3, 40))
    runs = {}
    for kernel in (prepack.NATIVE_AVX2, prepack.ONEDNN):
        program = core.load_program(STEP, check_guards=False)
        weights = prepack.prepack([program], core.load_weights("cpu"), kernel)
        runs[kernel] = [
            run_prompt(program, weights, m.kv, m.limits.page_tokens, prompt, chunk=c).logprobs for c in (7, 5)
        ]
        if kernel == prepack.NATIVE_AVX2:
            targets = {n.target for n in program.module.graph.nodes if n.op == "call_function"}
            assert torch.ops.flare_native.linear_avx2.default in targets
            assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())
    avx2, onednn = runs[prepack.NATIVE_AVX2], runs[prepack.ONEDNN]
    assert torch.equal(avx2[0], avx2[1])
    assert float((avx2[0] - onednn[0]).abs().max()) < 1e-3


@pytest.mark.usefixtures("avx2_kernel")
def test_an_fp32_compiled_step_runs_on_it(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Export measures (here: is told) the AVX2 kernel for an fp32 core's compiled step too."""
    out = tmp_path_factory.mktemp("cores") / "tiny-fp32-avx2-compiled"
    options = ExportOptions(out=out, dtype="float32", compile_step=True)
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), options)
    core = Core.open(out)
    spec = core.manifest.compiled[STEP]
    assert '"flare_native::linear_avx2"' in (out / spec.file).with_suffix(".json").read_text()
    assert spec.max_abs_diff <= core.manifest.golden.tolerance
    engine = build_engine(core, EngineConfig(num_pages=64))
    assert engine.executor.step_kind == "compiled" and engine.executor.linear_kernel == prepack.NATIVE_AVX2
    out_ = run_to_completion(engine, _requests(core, 6))
    assert all(len(choices[0].token_ids) == 6 for choices in out_.values())
