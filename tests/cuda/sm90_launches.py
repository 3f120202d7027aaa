"""Compile kernels for a Hopper GPU (sm_90) without one: the wrappers run on CPU tensors with every
Triton launch captured instead of run, then each distinct launch is compiled by Triton's NVIDIA
backend (bundled with the PyPI wheel, ptxas included) down to a cubin, and ptxas reports its
registers and spills. Catches what the interpreter cannot: code the GPU compiler rejects (types,
tl.dot shapes, constexpr branches) and register pressure.

Run in a process without TRITON_INTERPRET (tests/cuda/conftest.py sets it):
    python -m tests.cuda.sm90_launches moe recurrent   (or: sample, the decode path in bf16)
prints one line per compiled kernel and exits 1 if any failed to compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64"}


def _type(value: object) -> object:
    """Triton's signature type of a (non-constexpr) kernel argument: a tuple's (a NamedTuple's, as
    helios' Paged layout, keeping its type so that the kernel reads its fields by name) per element."""
    if isinstance(value, tuple):
        types = [_type(v) for v in value]
        return type(value)(*types) if hasattr(value, "_fields") else tuple(types)
    if isinstance(value, torch.Tensor):
        return _POINTERS[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if abs(value) < 2**31 else "i64"
    return "fp32"


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict[str, object], dict[str, object]]:
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constants = {}, {}
    for param, name in zip(fn.params, fn.arg_names):
        value = values[name]
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", value
        else:
            signature[name] = _type(value)
    return signature, constants


def compile_launches(run_wrappers: Callable[[], None]) -> list[str]:
    """Capture the launches `run_wrappers` makes, compile each distinct one for sm_90; one line each."""
    launches = []
    original = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    try:
        run_wrappers()
    finally:
        JITFunction.run = original
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    lines, seen = [], set()
    for fn, args, kwargs in launches:
        signature, constants = _signature(fn, args, kwargs)
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        key = (fn.__name__, tuple(signature.items()), repr(sorted(constants.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        name = f"{fn.__name__} {constants} {options}"
        try:
            compiled = triton.compile(
                ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options
            )
        except Exception as exc:  # noqa: BLE001  (reported, and the run fails)
            lines.append(f"FAILED {name}: {exc!r}"[:2000])
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            report = subprocess.run(
                [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                capture_output=True,
                text=True,
            ).stderr.split("Compiling entry function")[-1]
        usage = ", ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores", report))
        lines.append(f"ok {name}: {usage}, {compiled.metadata.shared} bytes shared")
    return lines


def _moe_launches(sample: bool = False) -> None:
    from helios.core.ops.moe import ACTIVATIONS
    from helios.engine.cuda import moe

    experts, hidden, ffn, top_k = 64, 2048, 768, 8
    for dtype in (torch.bfloat16,) if sample else (torch.bfloat16, torch.float32):
        for activation in ACTIVATIONS[:1] if sample else ACTIVATIONS:
            rows = ffn if activation == "relu2" else 2 * ffn
            for tokens in (4,) if sample else (4, 512):  # decode blocks of 16 rows, prefill blocks of 64
                ids = torch.randint(0, experts, (tokens, top_k))
                w_gate_up, w_down = torch.empty(experts, rows, hidden, dtype=dtype), torch.empty(experts, hidden, ffn)
                h, weights = torch.randn(tokens, hidden), torch.rand(tokens, top_k)
                moe.routed_experts(
                    h, weights, ids, w_gate_up, w_down.to(dtype), activation, 7.0 * (activation != "relu2")
                )
        if not sample:
            moe.routed_experts(h, weights, ids, w_gate_up, w_down.to(dtype), post_norm_scale=torch.ones(hidden))


def _recurrent_launches(sample: bool = False) -> None:
    from helios.engine.cuda import recurrent

    tokens, seqs = 64, 4
    layout = (torch.arange(seqs), torch.linspace(0, tokens, seqs + 1).to(torch.int32), torch.zeros(tokens).long())
    for dtype in (torch.bfloat16,) if sample else (torch.bfloat16, torch.float32):
        x, weight = torch.randn(tokens, 4096).to(dtype), torch.randn(4096, 4).to(dtype)
        recurrent.causal_conv1d(x, weight, weight[:, 0], torch.zeros(8, 4096, 3, dtype=dtype), *layout, True)
    heads, dim, groups, state = 128, 64, 8, 128  # Nemotron-H's Mamba-2 mixer
    key_heads, value_heads, k_dim, v_dim = 16, 32, 128, 128  # Qwen3-Next's gated DeltaNet
    for chunked in (False,) if sample else (False, True):  # the chunked forms take 5-20 s each
        bc = torch.randn(tokens, groups, state).bfloat16()
        scan = (torch.randn(tokens, heads, dim).bfloat16(), torch.randn(tokens, heads), -torch.rand(heads), bc, bc)
        pool = torch.zeros(8, heads, dim, state)
        recurrent.mamba2_scan(*scan, torch.ones(heads), torch.zeros(heads), pool, *layout, form=recurrent.Form(chunked))
        for kda in (False, True):
            qk = torch.randn(tokens, value_heads if kda else key_heads, k_dim).bfloat16()
            gate = -torch.rand(tokens, value_heads, k_dim) if kda else -torch.rand(tokens, value_heads)
            v, beta = torch.randn(tokens, value_heads, v_dim).bfloat16(), torch.rand(tokens, value_heads).bfloat16()
            pool = torch.zeros(8, value_heads, k_dim, v_dim)
            recurrent.delta_rule(qk, qk, v, gate, beta, pool, *layout, 0.1, True, form=recurrent.Form(chunked))


# what each argument compiles: "sample" (CI) is the decode path, bf16
FAMILIES = {
    "moe": _moe_launches,
    "recurrent": _recurrent_launches,
    "sample": lambda: (_moe_launches(sample=True), _recurrent_launches(sample=True)),
}


def main(launches: dict[str, Callable[[], None]], names: list[str]) -> int:
    """Compile the launches of each named entry of `launches`, print one line per kernel; 1 if any
    failed to compile (this module's FAMILIES, and tests.cuda.sm90_paged_launches' GROUPS)."""
    assert not os.environ.get("TRITON_INTERPRET"), "compile for the GPU: run without TRITON_INTERPRET"
    lines = [line for name in names for line in compile_launches(launches[name])]
    print("\n".join(lines))
    return int(any(line.startswith("FAILED") for line in lines))


if __name__ == "__main__":
    sys.exit(main(FAMILIES, sys.argv[1:] or ["moe", "recurrent"]))
