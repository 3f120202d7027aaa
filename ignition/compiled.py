"""The compiled step: a program built ahead of time with AOTInductor for the export host.

The portable program runs node by node from Python: about fifty graph nodes per layer, each
a separate dispatch. Compiled, the norms, rotary, casts and activations of a layer fuse into
a handful of C++ loops, the linears run on weights packed once at build time (they are
constants of the package), and nothing goes through Python except the flare:: attention ops.
The linears use the kernel helios would choose on this host (helios.engine.prepack.choose):
oneDNN, or for bfloat16 weights helios' native AVX512-BF16 kernel, which the package then
calls by name (helios loads it before the package, and serves the portable program where it
cannot). The package is machine code for this CPU's instruction set, so the manifest records
the host it was built on and helios falls back to the portable program elsewhere.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from helios.core.program import Program
from helios.engine import native, prepack


class _Frozen(torch.nn.Module):
    """The portable program with its weights as constants: what AOTInductor freezes and packs."""

    def __init__(self, program: Program, weights: dict[str, Tensor]) -> None:
        super().__init__()
        # Not a submodule: an unlifted exported module refuses train()/eval(), and it holds
        # no state of its own (its weights are the dict passed to it).
        object.__setattr__(self, "inner", program.module)
        self.names = tuple(weights)
        for index, name in enumerate(self.names):  # parameter names may not contain dots
            setattr(self, f"w{index}", torch.nn.Parameter(weights[name], requires_grad=False))

    def forward(self, kv_cache: list[Tensor], *inputs: Tensor) -> Any:
        weights = {name: getattr(self, f"w{index}") for index, name in enumerate(self.names)}
        return self.inner(weights, kv_cache, *inputs)


def compile_program(
    program: Program,
    weights: dict[str, Tensor],
    kv_cache: list[Tensor],
    inputs: list[Tensor],
    dynamic: tuple[Any, ...],
    path: Path,
) -> None:
    """Build `program` with AOTInductor for this host into the shared object `path`.

    The package AOTInductor writes is a zip that its loader extracts on every start (seconds
    for a model's worth of constants); the core keeps only the shared object in it, which
    helios loads in place.

    `kv_cache` and `inputs` are example values (shapes >= 2 where dynamic) and `dynamic`
    the portable program's dynamic shapes for the cache list and each input, in order.
    """
    native.load()
    kernel = prepack.choose([program], weights)
    if kernel in prepack.NATIVE_KERNELS:  # the package's linears call flare_native::linear(_tiles) on packed constants
        weights = prepack.prepack([program], weights, kernel)
    module = _Frozen(program, weights)
    with torch.no_grad():
        exported = torch.export.export(module, (kv_cache, *inputs), dynamic_shapes=(dynamic[0], tuple(dynamic[1:])))
        # freezing: weights become constants that oneDNN packs once; emulate_precision_casts:
        # fused loops round at every cast the program makes, as the portable program does,
        # so the compiled and portable programs agree on 16-bit cores too.
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            package = Path(scratch) / "package.pt2"
            torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(package),
                inductor_configs={"freezing": True, "emulate_precision_casts": True},
            )
            with zipfile.ZipFile(package) as archive:
                objects = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
                if len(objects) != 1:
                    raise RuntimeError(f"expected one shared object in the AOTInductor package, found {objects}")
                # The loader finds the custom ops' call descriptions in the .json beside the .so.
                stem = objects[0].removesuffix(".so")
                for member, target in ((stem + ".so", path), (stem + ".json", path.with_suffix(".json"))):
                    with archive.open(member) as source, target.open("wb") as out:
                        shutil.copyfileobj(source, out, 1 << 22)
