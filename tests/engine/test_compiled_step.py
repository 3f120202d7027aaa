"""The compiled step (ignition export --compile-step): recorded for its host, run by the
engine where the host matches, identical greedy output to the portable step, and a
clean fallback to the portable step anywhere else."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from helios.core import Core, host
from helios.core.manifest import HostFingerprint
from helios.core.program import STEP
from helios.engine.offline import run_to_completion
from tests.engine.test_runtime import PREAMBLE, _check_batching_invariance, _engine, _requests, _tokens


@pytest.fixture(scope="module")
def tiny(tiny_core: Path) -> Core:
    return Core.open(tiny_core)


def test_the_manifest_records_the_host_and_the_check(tiny: Core) -> None:
    spec = tiny.manifest.compiled[STEP]
    assert spec.host == host.fingerprint()
    assert spec.max_abs_diff <= tiny.manifest.golden.tolerance
    assert spec.file in tiny.manifest.files  # checksummed like every other file
    assert (tiny.root / spec.file).is_file()


def test_greedy_output_is_identical_with_and_without_it(tiny: Core) -> None:
    requests = _requests(tiny, 24, prefix=PREAMBLE)
    compiled = _engine(tiny)
    portable = _engine(tiny, compiled_step=False)
    assert compiled.executor.step_kind == "compiled" and portable.executor.step_kind == "portable"
    assert _tokens(run_to_completion(compiled, requests)) == _tokens(run_to_completion(portable, requests))


def test_batching_invariance_holds_on_it(tiny: Core) -> None:
    _check_batching_invariance(tiny, 16, prefix=PREAMBLE)


@pytest.mark.parametrize(
    "other",
    [
        lambda here: HostFingerprint(here.machine, tuple(f for f in here.isa if f != "avx2"), here.torch_version),
        lambda here: HostFingerprint(here.machine, here.isa, "0.0.1"),
        lambda here: HostFingerprint("riscv64", here.isa, here.torch_version),
    ],
    ids=["isa", "torch", "machine"],
)
def test_another_host_serves_the_portable_step(tiny: Core, monkeypatch: pytest.MonkeyPatch, other) -> None:
    here = host.fingerprint()
    monkeypatch.setattr(host, "fingerprint", lambda: other(here))
    engine = _engine(tiny)
    assert engine.executor.step_kind == "portable"
    assert "portable step" in (engine.executor.compiled_fallback or "")
    out = run_to_completion(engine, _requests(tiny, 4)[:2])
    assert all(len(choices[0].token_ids) == 4 for choices in out.values())


def test_a_package_that_fails_to_load_falls_back(tiny_core: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "core"
    shutil.copytree(tiny_core, copy)
    core = Core.open(copy)
    (copy / core.manifest.compiled[STEP].file).write_bytes(b"not a package")
    engine = _engine(Core.open(copy, verify_checksums=False))
    assert engine.executor.step_kind == "portable"
    assert "failed to load" in (engine.executor.compiled_fallback or "")


def test_the_step_runs_with_the_gil_released(tiny: Core) -> None:
    """Run through the native library, the compiled step lets Python threads (the server's event
    loop) run meanwhile; torch's own runner holds the GIL for the whole step."""
    from helios.engine import native

    if not native.load():
        pytest.skip(f"native kernels unavailable: {native.status()}")
    engine = _engine(tiny)
    step = engine.executor.compiled_step
    assert isinstance(step.runner, native.CompiledRunner)
    probe = engine.executor.probe_inputs(8)
    args = [*engine.executor.kv, *(probe[name] for name in step.input_names)]
    ticks, running = [0], threading.Event()

    def spin() -> None:
        while running.is_set():
            ticks[0] += 1

    thread = threading.Thread(target=spin)
    running.set()
    thread.start()
    try:
        while ticks[0] == 0:  # the spinner is running
            pass
        during, deadline = 0, time.monotonic() + 30  # the spinner may not get a core at once on a busy host
        while during == 0 and time.monotonic() < deadline:
            before = ticks[0]
            step.runner.run(args)  # no Python bytecode runs on this thread meanwhile
            during = ticks[0] - before
    finally:
        running.clear()
        thread.join()
    assert during > 0
