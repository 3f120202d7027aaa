"""The recurrent-state ops' Triton kernels (helios.engine.cuda.recurrent) under Triton's interpreter
against the core's references: flare::causal_conv1d (helios.core.ops.recurrent), mamba2_scan
(core.ops.mamba), gated_delta_rule (core.ops.gated_delta) and kda (core.ops.glm5_next), each scan in
its recurrent (decode) and its chunked (prefill) form, on steps mixing decode rows from a slot's
state, fresh one-token prompts, fresh prompts over several chunks, chunks continuing mid-sequence,
a padding sequence with no rows (slot -1) and a sequence whose slot is negative (the reference
counts it from the pool's end); fresh sequences' slots hold NaN (never read). Every public wrapper
also runs under no_host_reads (capturability). Tolerance: fp32 and bf16 inputs (both sides widen
the same values) 1e-5; causal_conv1d's bf16 output 1e-2 (one bf16 rounding). Then the families'
registration (moe's too) and an sm_90 compile of their kernels."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import triton
from torch import Tensor

import tests.cuda.interpreter_fixes  # noqa: F401  (the interpreter computes as a GPU does)
from helios.core.ops import gated_delta, glm5_next, mamba, recurrent
from helios.engine.cuda import moe
from helios.engine.cuda import recurrent as cuda
from tests.cuda.paged_steps import no_host_reads, reference

SLOTS = 7
CHUNK = 16  # the chunked forms' rows per chunk here: the prompts below span several
# (rows this step, first position, slot): first position 0 = a fresh sequence
MIXED = [(37, 0, 2), (1, 12, 5), (0, 0, -1), (1, 0, 0), (19, 21, 3), (1, 90, -1), (3, 5, 1)]
DECODE = [(1, 5, 4), (1, 0, 1), (0, 0, -1), (1, 44, 2), (1, 3, 0)]
CASES = {"mixed": MIXED, "decode": DECODE}
FP32 = {"rtol": 1e-5, "atol": 1e-5}


class Step(NamedTuple):
    state_slots: Tensor
    query_start_loc: Tensor
    positions: Tensor
    num_tokens: int


def _step(case: list[tuple[int, int, int]]) -> Step:
    counts = torch.tensor([n for n, _, _ in case])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    positions = torch.cat([torch.arange(p, p + n) for n, p, _ in case])
    return Step(torch.tensor([s for _, _, s in case]), starts, positions, int(counts.sum()))


def _pool(gen: torch.Generator, case: list[tuple[int, int, int]], *shape: int, dtype=torch.float32) -> Tensor:
    """A state pool, random where a continuing sequence reads it, NaN in fresh sequences' slots."""
    pool = torch.randn(SLOTS, *shape, generator=gen).to(dtype)
    for rows, first, slot in case:
        if rows and first == 0:
            pool[slot] = float("nan")
    return pool


def _strided(t: Tensor) -> Tensor:
    """t's values as a view into a wider buffer (rows strided, as a slice of a fused projection)."""
    wide = torch.zeros(t.shape[0], t[0].numel() + 5, dtype=t.dtype)
    wide[:, 5:] = t.reshape(t.shape[0], -1)
    return wide[:, 5:].view(t.shape)


def _same_state(got: Tensor, expected: Tensor, **tol: float) -> None:
    """Pools equal (NaN where the reference left a fresh sequence's untouched slot)."""
    torch.testing.assert_close(got, expected, equal_nan=True, **tol)


# --- causal_conv1d ------------------------------------------------------------------------------

CHANNELS, WIDTH = 6, 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_causal_conv1d_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    """The reference cannot take a sequence with no rows (its window is shorter than the filter):
    it runs the step without the padding sequence, which the kernel skips (its slot untouched)."""
    case = CASES[name]
    step = _step(case)
    reference_step = _step([seq for seq in case if seq[0]])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(step.num_tokens, CHANNELS, generator=gen).to(dtype)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=gen), torch.randn(CHANNELS, generator=gen)
    pool = _pool(gen, case, CHANNELS, WIDTH - 1, dtype=dtype)
    for silu in (True, False):
        expected_state, state = pool.clone(), pool.clone()
        expected = reference(recurrent.causal_conv1d)(x, weight, bias, expected_state, *reference_step[:3], silu)
        with no_host_reads():
            got = cuda.causal_conv1d(_strided(x), weight, bias, state, *step[:3], silu)
        tol = FP32 if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}  # one bf16 rounding of y
        torch.testing.assert_close(got, expected, **tol)
        _same_state(state, expected_state, rtol=0.0, atol=0.0)  # copies of the inputs


# --- mamba2_scan --------------------------------------------------------------------------------

HEADS, DIM, GROUPS, STATE = 4, 4, 2, 5  # heads of DIM channels, GROUPS groups of B/C of size STATE


def _mamba_inputs(case: list[tuple[int, int, int]], dtype: torch.dtype, seed: int = 2):
    step = _step(case)
    gen = torch.Generator().manual_seed(seed)
    total = step.num_tokens
    x = torch.randn(total, HEADS, DIM, generator=gen).to(dtype)
    dt = torch.randn(total, HEADS, generator=gen)
    b = torch.randn(total, GROUPS, STATE, generator=gen).to(dtype)
    c = torch.randn(total, GROUPS, STATE, generator=gen).to(dtype)
    a = -torch.exp(torch.rand(HEADS, generator=gen) * 2.0)
    d = 1.0 + 0.1 * torch.randn(HEADS, generator=gen)
    dt_bias = torch.randn(HEADS, generator=gen) - 2.0
    pool = _pool(gen, case, HEADS, DIM, STATE)
    return (x, dt, a, b, c, d, dt_bias), pool, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 inputs"])
@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_mamba2_scan_matches_the_reference(name: str, chunked: bool, dtype: torch.dtype) -> None:
    """Both forms on both layouts; dt clamped to [dt_min, dt_max] (Nemotron-H) in the mixed case."""
    inputs, pool, step = _mamba_inputs(CASES[name], dtype)
    limits = (1e-3, 0.1) if name == "mixed" else (0.0, 0.0)
    expected_state, state = pool.clone(), pool.clone()
    expected = reference(mamba.mamba2_scan)(*inputs, expected_state, *step[:3], *limits)
    got = cuda.mamba2_scan(*inputs, state, *step[:3], *limits, form=cuda.Form(chunked, CHUNK))
    torch.testing.assert_close(got, expected, **FP32)  # bf16 inputs: both widen the same values
    _same_state(state, expected_state, **FP32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mamba2_scan_wrapper_is_capturable(name: str) -> None:
    inputs, pool, step = _mamba_inputs(CASES[name], torch.float32, seed=3)
    expected_state, state = pool.clone(), pool.clone()
    expected = reference(mamba.mamba2_scan)(*inputs, expected_state, *step[:3])
    x, dt, a, b, c, d, dt_bias = inputs
    with no_host_reads():  # x, B and C as slices of wider rows
        got = cuda.mamba2_scan(_strided(x), dt, a, _strided(b), _strided(c), d, dt_bias, state, *step[:3])
    torch.testing.assert_close(got, expected, **FP32)
    _same_state(state, expected_state, **FP32)


# --- gated_delta_rule and kda -------------------------------------------------------------------

KEY_HEADS, VALUE_HEADS, K_DIM, V_DIM = 1, 2, 8, 6


def _delta_inputs(case: list[tuple[int, int, int]], kda: bool, dtype: torch.dtype, seed: int):
    """(q, k, v, g, beta), pool, step: gated DeltaNet with GQA (1 key head, 2 value heads), or KDA
    (2 heads, one log decay per key channel)."""
    step = _step(case)
    gen = torch.Generator().manual_seed(seed)
    total = step.num_tokens
    key_heads = VALUE_HEADS if kda else KEY_HEADS
    # |k| about 1 unnormalized too: beta |k|^2 > 2 would make the raw recurrence itself blow up
    q = (torch.randn(total, key_heads, K_DIM, generator=gen) * K_DIM**-0.5).to(dtype)
    k = (torch.randn(total, key_heads, K_DIM, generator=gen) * K_DIM**-0.5).to(dtype)
    v = torch.randn(total, VALUE_HEADS, V_DIM, generator=gen).to(dtype)
    g_shape = (total, VALUE_HEADS, K_DIM) if kda else (total, VALUE_HEADS)
    g = -torch.rand(*g_shape, generator=gen) * (2.0 if kda else 0.5)
    beta = torch.rand(total, VALUE_HEADS, generator=gen)
    return (q, k, v, g, beta), _pool(gen, case, VALUE_HEADS, K_DIM, V_DIM) * 0.3, step


OPS = {  # the op's reference body, its CUDA wrapper
    "gated_delta_rule": (reference(gated_delta.gated_delta_rule), cuda.gated_delta_rule),
    "kda": (reference(glm5_next.kda), cuda.kda),
}


@pytest.mark.parametrize("norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_delta_rules_match_the_reference(op: str, chunked: bool, norm: bool) -> None:
    """Both forms on the mixed layout (and so the decode rows in it), q and k normalized or raw."""
    inputs, pool, step = _delta_inputs(MIXED, op == "kda", torch.float32, seed=4 + norm)
    scale = K_DIM**-0.5
    expected_state, state = pool.clone(), pool.clone()
    expected = OPS[op][0](*inputs, expected_state, *step[:3], scale, norm)
    got = cuda.delta_rule(*inputs, state, *step[:3], scale, norm, form=cuda.Form(chunked, CHUNK))
    torch.testing.assert_close(got, expected, **FP32)
    _same_state(state, expected_state, **FP32)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("op", sorted(OPS))
def test_delta_rule_wrappers_are_capturable(op: str, name: str) -> None:
    """The wrappers (their own form and chunk size) under no_host_reads, on strided bf16 q, k, v
    (both sides widen the same values)."""
    inputs, pool, step = _delta_inputs(CASES[name], op == "kda", torch.bfloat16, seed=6)
    expected_state, state = pool.clone(), pool.clone()
    expected = OPS[op][0](*inputs, expected_state, *step[:3], K_DIM**-0.5, True)
    q, k, v, g, beta = inputs
    with no_host_reads():  # q, k, v as slices of wider rows
        got = OPS[op][1](_strided(q), _strided(k), _strided(v), g, beta, state, *step[:3], K_DIM**-0.5, True)
    torch.testing.assert_close(got, expected, **FP32)
    _same_state(state, expected_state, **FP32)


# --- registration -------------------------------------------------------------------------------


class _Recording:
    """Stands in for the flare IMPL library: records what a family installs in the CUDA slot."""

    def __init__(self) -> None:
        self.kernels: dict[str, Callable] = {}

    def impl(self, name: str, kernel: Callable, key: str) -> None:
        assert key == "CUDA"
        self.kernels[name] = kernel


def test_families_install_kernels_taking_the_ops_arguments() -> None:
    """moe and recurrent install one kernel per op, each with its op's argument names and defaults,
    as the dispatcher hands them over (helios.core.ops schemas), then at most keyword-only ones."""
    recording = _Recording()
    moe.register(recording)
    cuda.register(recording)
    assert sorted(recording.kernels) == ["causal_conv1d", "gated_delta_rule", "kda", "mamba2_scan", "routed_experts"]
    for name, kernel in recording.kernels.items():
        schema = getattr(torch.ops.flare, name).default._schema
        expected = [
            (a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty) for a in schema.arguments
        ]
        params = inspect.signature(kernel).parameters.values()  # past the schema: keyword-only (Form), unused by it
        assert [(p.name, p.default) for p in params if p.kind != p.KEYWORD_ONLY] == expected, name


PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel has no ptxas")
def test_moe_and_recurrent_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """Each kernel launch of the two families compiles for an H100/H200 (sm_90) down to a cubin
    (tests.cuda.sm90_launches, in a subprocess without the interpreter): the decode path in CI,
    every form and dtype with FLARE_SLOW_TESTS."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    families = ["moe", "recurrent"] if os.environ.get("FLARE_SLOW_TESTS") else ["sample"]
    run = subprocess.run(
        [sys.executable, "-m", "tests.cuda.sm90_launches", *families],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) >= 7, run.stdout
