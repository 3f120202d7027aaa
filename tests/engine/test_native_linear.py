"""bfloat16 linears on helios' native kernel: the measured choice, the load-time rewrite of the
portable programs, and a compiled step built around it (export) with its fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core import Core, hostcache
from helios.core.program import STEP, run_prompt
from helios.engine import native, precision, prepack
from helios.engine.offline import run_to_completion
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.engine.test_runtime import _engine, _requests

pytestmark = pytest.mark.skipif(
    not (native.load() and torch.ops.flare_native.has_bf16_linear()),
    reason="this CPU/compiler has no AVX512-BF16: the native linear is not built",
)


@pytest.fixture(autouse=True)
def bf16_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's bf16-vs-fp32 matmul measurement (precision.is_native) can come out either way
    on a busy machine; these tests are about the bf16 kernels, so the core is never upcast."""
    monkeypatch.setattr(precision, "is_native", lambda dtype: True)


@pytest.fixture(scope="module")
def native_core(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bfloat16 tiny core whose compiled step was built on the native linear (the choice forced,
    whatever this host measures)."""
    out = tmp_path_factory.mktemp("cores") / "tiny-bf16-native"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepack, "choose", lambda programs, weights: prepack.NATIVE)
        export_core(
            open_source(str(tiny_checkpoint)),
            load_recipe("smollm2"),
            ExportOptions(out=out, dtype="bfloat16", compile_step=True),
        )
    return out


def test_the_compiled_step_calls_the_native_linear(native_core: Path) -> None:
    core = Core.open(native_core)
    spec = core.manifest.compiled[STEP]
    assert "flare_native::linear" in (native_core / spec.file).with_suffix(".json").read_text()
    assert spec.max_abs_diff <= core.manifest.golden.tolerance  # export's self-check against the portable step
    engine = _engine(core)
    assert engine.executor.step_kind == "compiled"
    out = run_to_completion(engine, _requests(core, 6))
    assert all(len(choices[0].token_ids) == 6 for choices in out.values())


def test_without_the_native_kernels_the_portable_step_serves(
    native_core: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "loaded", lambda: False)
    engine = _engine(Core.open(native_core))
    assert engine.executor.step_kind == "portable"
    assert "native kernels" in (engine.executor.compiled_fallback or "")
    assert engine.executor.linear_kernel == prepack.ONEDNN
    out = run_to_completion(engine, _requests(engine.core, 4)[:2])
    assert all(len(choices[0].token_ids) == 4 for choices in out.values())


KERNELS = (
    [prepack.ONEDNN, prepack.NATIVE]
    + ([prepack.NATIVE_TILES] if prepack.tiles_available() else [])
    + ([prepack.NATIVE_AVX2] if prepack.avx2_available() else [])
)


def test_portable_programs_agree_on_every_kernel(native_core: Path) -> None:
    """The rewrite changes the kernel, not the model: full-vocabulary logprobs of every rewrite
    agree to within bfloat16 rounding of the linears' outputs."""
    core = Core.open(native_core)
    runs = []
    for kernel in KERNELS:
        program = core.load_program(STEP, check_guards=False)
        weights = prepack.prepack([program], core.load_weights("cpu"), kernel)
        targets = {n.target for n in program.module.graph.nodes if n.op == "call_function"}
        assert (torch.ops.flare_native.linear.default in targets) == (kernel == prepack.NATIVE)
        assert (torch.ops.flare_native.linear_tiles.default in targets) == (kernel == prepack.NATIVE_TILES)
        assert (torch.ops.flare_native.linear_avx2.default in targets) == (kernel == prepack.NATIVE_AVX2)
        runs.append(
            run_prompt(
                program, weights, core.manifest.kv, core.manifest.limits.page_tokens, list(range(3, 40)), chunk=7
            ).logprobs
        )
    for other in runs[1:]:
        assert float((runs[0] - other).abs().max()) < 0.1


def _timed(monkeypatch: pytest.MonkeyPatch, times: dict[str, tuple[float, float]]) -> None:
    """choose() sees these kernel -> (ms at 1 row, ms at 32 rows); a kernel this host lacks is never
    timed. The AVX2 kernel, where it runs, is slower than the others unless given."""
    times = {prepack.NATIVE_AVX2: (100.0, 100.0), **times}
    timings = {(kernel, rows): ms[index] for kernel, ms in times.items() for index, rows in enumerate((1, 32))}
    monkeypatch.setattr(prepack, "_pack_sample", lambda kernel, sample: [])
    monkeypatch.setattr(prepack, "_measure", lambda kernel, rows, sample, packed: timings[(kernel, rows)])


def test_the_choice_is_measured_once_and_remembered(
    native_core: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    core = Core.open(native_core)
    program = core.load_program(STEP, check_guards=False)
    weights = core.load_weights("cpu")
    _timed(monkeypatch, {prepack.NATIVE: (1.0, 10.0), prepack.ONEDNN: (2.0, 10.0), prepack.NATIVE_TILES: (1.5, 10.1)})
    assert prepack.choose([program], weights) == prepack.NATIVE
    monkeypatch.setattr(prepack, "_measure", lambda *args: pytest.fail("measured again"))
    assert prepack.choose([program], weights) == prepack.NATIVE  # remembered
    assert hostcache.load("linear-kernel")


def test_slower_at_many_rows_means_onednn(native_core: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    core = Core.open(native_core)
    _timed(
        monkeypatch,
        {
            prepack.NATIVE: (1.0, 12.0),  # faster at one row, 20% slower at 32
            prepack.ONEDNN: (2.0, 10.0),
            prepack.NATIVE_TILES: (1.0, 11.0),
        },
    )
    assert prepack.choose([core.load_program(STEP, check_guards=False)], core.load_weights("cpu")) == prepack.ONEDNN


@pytest.mark.skipif(not prepack.tiles_available(), reason="this CPU has no AMX-BF16")
def test_tiles_win_where_they_are_as_fast_at_one_row_and_fastest_at_many(
    native_core: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    core = Core.open(native_core)
    _timed(
        monkeypatch, {prepack.NATIVE: (12.8, 53.0), prepack.ONEDNN: (17.5, 19.7), prepack.NATIVE_TILES: (12.5, 15.2)}
    )
    program = core.load_program(STEP, check_guards=False)
    kernel = prepack.choose([program], core.load_weights("cpu"))
    assert kernel == prepack.NATIVE_TILES


def test_float32_weights_are_measured_only_on_kernels_that_take_them(
    tiny_core: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fp32 weights go to oneDNN or, where AVX2 and FMA are, the AVX2 kernel, whichever measures
    faster; the bfloat16-only kernels are never candidates, however fast they would time."""
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    core = Core.open(tiny_core)
    assert core.manifest.weights.dtype == "float32"
    program, weights = core.load_program(STEP, check_guards=False), core.load_weights("cpu")
    bf16_only = {prepack.NATIVE: (0.1, 0.1), prepack.NATIVE_TILES: (0.1, 0.1)}
    _timed(monkeypatch, {**bf16_only, prepack.ONEDNN: (2.0, 10.0), prepack.NATIVE_AVX2: (3.0, 12.0)})
    assert prepack.choose([program], weights) == prepack.ONEDNN
    if prepack.NATIVE_AVX2 in prepack.native_kernels():
        monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path / "again"))
        _timed(monkeypatch, {**bf16_only, prepack.ONEDNN: (2.0, 10.0), prepack.NATIVE_AVX2: (1.0, 10.1)})
        assert prepack.choose([program], weights) == prepack.NATIVE_AVX2
