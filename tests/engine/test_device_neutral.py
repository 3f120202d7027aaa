"""Exported programs are device-neutral: what ignition exports names no device (but the exporter's
metadata asserts), and a program helios loads for a device runs there with every input, weight and
cache on that device. Checked on the `meta` device, where a hidden CPU constant fails the step
(`Tensor on device cpu is not on the expected device meta!`) as it would on CUDA; the flare:: ops'
fake kernels serve the Meta key. Also: the CUDA slot of every flare:: op is filled when the engine
prepares a CUDA device (helios.engine.cuda, its Triton kernels), or a missing triton says so.

Each family's tiny step is exported alone (no core, no self-check); a sample of families runs in
CI, every family with FLARE_SLOW_TESTS=1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.manifest import KvLayout, ProgramSpec
from helios.core.ops.catalog import OPS
from helios.core.program import SCORED_PREFILL, STEP, Program
from helios.engine import devices, graph
from helios.engine.cuda import registry as cuda_registry
from helios.engine.executor import Executor
from ignition.examples import example_caches, example_inputs
from ignition.export import export_program, internal_weights, kv_layout
from ignition.models import FAMILIES, common
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

PAGE = 16
# One family per kind of flare:: op and attention layout (dense GQA, sliding windows, routed experts,
# Mamba-2, MLA with sparse indexing); the others with FLARE_SLOW_TESTS=1.
SAMPLE = ("llama", "gemma3", "qwen3_moe", "nemotron_h", "glm_moe_dsa")
SLOW = pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")
FAMILY_CASES = [f if f in SAMPLE else pytest.param(f, marks=SLOW) for f in FAMILIES]


@dataclass(frozen=True, slots=True)
class Exported:
    """One program of a family's tiny checkpoint, saved as a core holds it, and what it runs on."""

    program: Path
    spec: ProgramSpec
    weights: dict[str, torch.Tensor]
    kv: KvLayout
    vocab_size: int


def export_tiny_program(family: str, out: Path, kind: str = STEP) -> Exported:
    """The family's tiny checkpoint's `kind` program (top-5 and explicit-id logprobs), exported as
    export_core exports it, fp32."""
    fam = FAMILIES[family]
    checkpoint = open_source(str(write_testmodel(family, out / "checkpoint", seed=0)))
    config = fam.config_from_hf(checkpoint.hf_config)
    if fam.canonical_tensors is not None:
        checkpoint = replace(checkpoint, tensors=fam.canonical_tensors(config, checkpoint.tensors))
    weights = internal_weights(fam, checkpoint, config, torch.float32)
    kv = kv_layout(fam, config, "float32")
    path = out / "programs" / f"{kind}.pt2"
    spec = export_program(fam, config, kind, 5, True, weights, kv, PAGE, path)
    return Exported(path, spec, weights, kv, config.vocab_size)  # type: ignore[attr-defined]


def device_nodes(program: Program) -> list[str]:
    """The graph's calls that name a device, but the exporter's metadata asserts."""
    named = []
    for node in program.module.graph.nodes:
        if node.op != "call_function" or node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue
        values = [*node.args, *node.kwargs.values()]
        if any(isinstance(v, torch.device) for v in values):
            named.append(node.format_node())
    return named


def run_on(exported: Exported, kind: str, device: str) -> dict[str, torch.Tensor]:
    """The program loaded as the executor loads it for `device` (graph.place), run on the exporter's
    example inputs with every input, weight and cache on `device`."""
    program = Program.load(kind, exported.spec, exported.program, check_guards=False)
    graph.place(program, device)
    weights = {name: w.to(device) for name, w in exported.weights.items()}
    caches = [c.to(device) for c in example_caches(exported.kv, PAGE)]
    examples = example_inputs(program.spec.inputs, exported.vocab_size, PAGE)
    inputs = {name: t.to(device) for name, t in zip(program.input_names, examples, strict=True)}
    return program(weights, caches, **inputs)


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_a_family_step_names_no_device_and_runs_on_meta(family: str, tmp_path: Path) -> None:
    exported = export_tiny_program(family, tmp_path)
    loaded = Program.load(STEP, exported.spec, exported.program, check_guards=False)
    assert device_nodes(loaded) == []  # the export device is not written into the program
    outputs = run_on(exported, STEP, "meta")
    assert set(outputs) >= set(loaded.output_names)
    rows = 2  # the example's logits rows
    assert all(value.device.type == "meta" for value in outputs.values())
    assert outputs["logits"].shape == (rows, exported.vocab_size)
    assert outputs["top_ids"].shape == (rows, 5)


def test_the_scored_prefill_runs_on_meta(tmp_path: Path) -> None:
    exported = export_tiny_program("llama", tmp_path, SCORED_PREFILL)
    outputs = run_on(exported, SCORED_PREFILL, "meta")
    assert outputs["prompt_logprobs"].device.type == "meta"
    assert outputs["prompt_logprobs"].shape == (5,)  # one per example token


def _old_arange_like(like: torch.Tensor, end: int, step: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rotary exponents as ignition traced them before programs were device-neutral."""
    return torch.arange(0, end, step, dtype=torch.int64, device=like.device).to(dtype)


def test_a_program_exported_with_device_constants_is_retargeted_and_unchanged_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cores exported before the change (arange(..., device=cpu) in the step) still run on the CPU,
    with the same logits bit for bit, and run on another device once placed there."""
    with monkeypatch.context() as patch:
        patch.setattr(common, "arange_like", _old_arange_like)
        old = export_tiny_program("llama", tmp_path / "old")
    new = export_tiny_program("llama", tmp_path / "new")
    loaded = Program.load(STEP, old.spec, old.program, check_guards=False)
    assert any("arange" in line and "device: cpu" in line for line in device_nodes(loaded))
    assert torch.equal(run_on(old, STEP, "cpu")["logits"], run_on(new, STEP, "cpu")["logits"])
    assert run_on(old, STEP, "meta")["logits"].device.type == "meta"
    placed = Program.load(STEP, old.spec, old.program, check_guards=False)
    assert graph.place(placed, "meta") > 0
    lines = [node.format_node() for node in placed.module.graph.nodes]
    assert not any("device: cpu" in line or "_assert_tensor_metadata" in line for line in lines)


def test_the_executor_places_every_program_for_its_device(tiny_core: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device, the engine's first step is a startup probe (the speculation row budget) of the
    core's step, before any graph is captured: it runs there, the scored prefill is placed too."""
    load = Core.load_stored

    def placed(core: Core, device: str = "cpu") -> tuple[dict, dict]:  # safetensors reads no `meta` tensors
        plain, stored = load(core)
        return {k: w.to(device) for k, w in plain.items()}, stored

    monkeypatch.setattr(Core, "load_stored", placed)
    executor = Executor(Core.open(tiny_core), 8, "meta", compiled=False)
    outputs = executor.step(executor.weights, executor.kv, **executor.probe_inputs(2))
    assert outputs["logits"].device.type == "meta"
    assert executor.scored is not None and device_nodes(executor.scored) == []
    for program in (executor.step, executor.scored):
        assert not any("_assert_tensor_metadata" in n.format_node() for n in program.module.graph.nodes)


# --------------------------------------------------------------------------- the CUDA kernels' slot


def test_preparing_a_cuda_device_fills_the_cuda_slot_of_every_flare_op() -> None:
    pytest.importorskip("triton")
    devices.prepare("cuda")
    devices.prepare("cuda:0")  # once per process: a second device or executor changes nothing
    # The collectives' kernels are torch.distributed calls, which run on any device (NCCL on CUDA).
    kernels = [op for op, module in OPS.items() if module != "collectives"]
    empty = [op for op in kernels if not torch._C._dispatch_has_kernel_for_dispatch_key(f"flare::{op}", "CUDA")]
    assert empty == []


def test_cuda_without_triton_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_registry, "_library", None)
    for name in [m for m in sys.modules if m.startswith("helios.engine.cuda.") and m != cuda_registry.__name__]:
        monkeypatch.delitem(sys.modules, name)  # the kernel modules are imported again, and import triton
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` fails as where it is not installed
    with pytest.raises(devices.DeviceError, match="needs triton"):
        devices.prepare("cuda")
    devices.prepare("cpu")  # nothing to install for the CPU
