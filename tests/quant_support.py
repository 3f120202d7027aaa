"""Quantized test cores, their dequantized twins, and a plain-torch stand-in for the native
quantized linear ops (shared by tests/engine/test_quantized_load.py and
tests/server/test_quantized_serving.py).

A quantized core is a tiny checkpoint exported with `ignition export --quantize`; its twin is the
same core holding exactly the dequantized float values (the reference the served logprobs must
match).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from helios.core import Core, quant
from helios.core import manifest as mf
from helios.engine import native
from ignition.export import ExportOptions, export_core
from ignition.quantize import QuantRequest
from ignition.recipe import load_recipe
from ignition.sources import open_source


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unquantized(core: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Store `tensors` as the core's weights file, recorded as an unquantized core's."""
    manifest = mf.decode((core / mf.MANIFEST_FILE).read_bytes())
    path = core / manifest.weights.file
    save_file(tensors, str(path))
    files = dict(manifest.files) | {manifest.weights.file: _sha256(path)}
    manifest = msgspec.structs.replace(manifest, files=files, quantization=None)
    (core / mf.MANIFEST_FILE).write_bytes(mf.encode(manifest))


def export_quantized(checkpoint: Path, recipe: str, out: Path, fmt: str, embeddings: bool = False) -> Path:
    """`ignition export --quantize fmt` of a test checkpoint (groups of 32, float32 scales; with
    --quantize-embeddings where `embeddings`)."""
    request = QuantRequest(fmt, 32, embeddings=embeddings)
    export_core(open_source(str(checkpoint)), load_recipe(recipe), ExportOptions(out=out, quantization=request))
    return out


def dequantized_core(quantized: Path, out: Path) -> Path:
    """The twin of a quantized core: the same core holding its dequantized weights as floats."""
    shutil.copytree(quantized, out)
    weights = Core.open(quantized).load_weights()
    _unquantized(out, {name: w.contiguous() for name, w in weights.items()})
    return out


def _pack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """The stand-in's blob: the exact float32 values' bytes, [..., out * in * 4]."""
    values = quant.dequantize(qweight, scales, mins, group, torch.float32)
    return values.reshape(*values.shape[:-2], -1).contiguous().view(torch.uint8)


def _qlinear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    weight = packed.contiguous().view(torch.float32).reshape(out_features, -1)
    # Each output a plain product-sum over its row (not a GEMM, whose reduction order changes with
    # the row count): a row's result does not depend on the rows beside it, as the contract asks.
    y = (x.float()[..., None, :] * weight).sum(-1)
    return (y if bias is None else y + bias.float()).to(x.dtype)


_STAND_IN: list[torch.library.Library] = []  # kept alive: dropping it unregisters the ops


def qlinear_ops() -> str:
    """The flare_native quantized ops for the native path's tests: the native library's where it
    has them and this host runs them ("native"), else a plain-torch stand-in with the same names
    and signatures ("stand-in"), defined once for the rest of the process (only quantized cores
    reach these ops). Raises LookupError where the library has them but this host cannot run them
    (nothing to stand in for)."""
    if _STAND_IN:
        return "stand-in"
    native.load()  # first: a stand-in must not take the names of ops the library defines
    try:
        has = torch.ops.flare_native.has_qlinear
    except AttributeError:
        has = None
    if has is not None:
        if not has():
            raise LookupError("the native library's quantized kernels do not run on this host")
        return "native"
    library = torch.library.Library("flare_native", "FRAGMENT")
    library.define("pack_qlinear(Tensor qweight, Tensor scales, Tensor? mins, int group) -> Tensor")
    library.define("qlinear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
    library.define("has_qlinear() -> bool")
    library.impl("pack_qlinear", _pack, "CompositeExplicitAutograd")
    library.impl("qlinear", _qlinear, "CompositeExplicitAutograd")
    library.impl("has_qlinear", lambda: True, "CompositeExplicitAutograd")
    _STAND_IN.append(library)
    return "stand-in"
