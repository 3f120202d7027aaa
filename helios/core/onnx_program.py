"""A core's ONNX renditions (`ignition export --onnx`) run under ONNX Runtime.

`onnx/onnx.json` (OnnxRecord) lists the rendered programs. Each `onnx/<kind>.onnx` takes the
same inputs as its torch program, by the manifest's names, after the paged caches
`kv_cache.N`; its initializers are the core's weights, external data in `onnx/weights.safetensors`
(the weights file, linked). ONNX cannot alias an input to an output, so each cache a program
writes is also an output `kv_cache.N.updated` (ScatterND over the cache). OnnxProgram binds
both to the same torch tensor memory (IO binding), so ONNX Runtime's ScatterND, which skips its
input copy when input and output are one buffer, updates the pool in place; where a result
lands elsewhere it is copied back into the cache tensor (`copied_back` counts those bytes).

OnnxProgram is called like helios.core.program.Program, so `run_prompt`, `ignition verify`
and helios' executor run either interchangeably.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from helios.core.bundle import CoreError
from helios.core.manifest import ProgramSpec
from helios.core.program import _Callable

ONNX_DIR = "onnx"
ONNX_WEIGHTS = "weights.safetensors"  # the core's weights file, linked (or copied) under onnx/
RECORD = "onnx.json"
OPSET = 18
CACHE_INPUT = "kv_cache.{}"
CACHE_OUTPUT = "kv_cache.{}.updated"
EXPORT_FLAG = "--onnx"


def output_name(name: str, spec: ProgramSpec) -> str:
    """An output's name in the ONNX graph: its own, or `NAME.output` where an input has the same
    name (the drafter's hidden_states in and out), as ONNX names every value once."""
    return f"{name}.output" if any(t.name == name for t in spec.inputs) else name


class OnnxUnavailable(CoreError):
    """The core has no ONNX rendition, or it cannot be loaded; the message says what to do."""


@dataclass(frozen=True, slots=True)
class OnnxRendition:
    """One program's ONNX file and the kv_cache positions it writes (its updated-cache outputs)."""

    file: str
    updated_caches: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OnnxRecord:
    """onnx/onnx.json: the opset and each rendered program kind."""

    opset: int
    programs: dict[str, OnnxRendition]

    @classmethod
    def build(cls, programs: dict[str, dict[str, Any]]) -> OnnxRecord:
        return cls(
            opset=OPSET,
            programs={
                kind: OnnxRendition(str(p["file"]), tuple(int(i) for i in p["updated_caches"]))
                for kind, p in programs.items()
            },
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "opset": self.opset,
            "programs": {
                k: {"file": p.file, "updated_caches": list(p.updated_caches)} for k, p in self.programs.items()
            },
        }

    @classmethod
    def read(cls, root: Path, files: dict[str, str]) -> OnnxRecord | None:
        """The record of the core at `root` (None: exported without --onnx)."""
        name = f"{ONNX_DIR}/{RECORD}"
        if name not in files:
            return None
        try:
            data = json.loads((root / name).read_text(encoding="utf-8"))
            return cls.build(data["programs"]) if data.get("opset") == OPSET else cls(int(data["opset"]), {})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OnnxUnavailable(f"{root / name}: unreadable ({exc}); re-export the core with {EXPORT_FLAG}") from exc


# The cache dtypes bound by pointer (numpy names ORT's element types; it has no bfloat16).
_ELEMENT = {torch.float32: np.float32, torch.float16: np.float16}


class OnnxProgram(_Callable):
    """An ONNX rendition of a program, run on ONNX Runtime's CPU provider. The weights argument
    is ignored (the initializers are the core's weights); the caches are updated in place."""

    def __init__(self, kind: str, spec: ProgramSpec, path: Path, updated: tuple[int, ...], threads: int = 0) -> None:
        """threads: ONNX Runtime's intra-op threads (0: its default, one per core)."""
        super().__init__(kind, spec)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own error classes (InvalidProtobuf, Fail, ...)
            raise OnnxUnavailable(
                f"{path}: ONNX Runtime cannot load the {kind} program ({str(exc)[:300]}); the file is corrupted "
                f"or was modified: re-export the core with {EXPORT_FLAG}"
            ) from exc
        self.path = path
        self.updated = updated
        graph_inputs = {i.name for i in self.session.get_inputs()}
        # every cache the graph reads (a drafter's reads only its own; a vision program none)
        self.cache_inputs = [i for i in range(len(graph_inputs)) if CACHE_INPUT.format(i) in graph_inputs]
        self.fed = [name for name in self.input_names if name in graph_inputs]  # an unused input may be pruned
        self.copied_back = 0  # bytes of updated caches ORT returned in its own buffers (copied into the pool)

    def _run(self, weights: dict[str, Tensor], kv_cache: list[Tensor], inputs: list[Tensor]) -> Any:
        binding = self.session.io_binding()
        keep: list[Any] = []  # what the bound buffers point into, alive until the run returns
        for index in self.cache_inputs:
            cache = kv_cache[index]
            element = _ELEMENT.get(cache.dtype)
            if element is None or not cache.is_contiguous() or cache.device.type != "cpu":
                raise OnnxUnavailable(
                    f"the ONNX {self.kind} program runs on contiguous CPU caches of {', '.join(map(str, _ELEMENT))}, "
                    f"not {cache.dtype} on {cache.device}: serve this core with the torch runtime"
                )
            shape, pointer = list(cache.shape), cache.data_ptr()
            binding.bind_input(CACHE_INPUT.format(index), "cpu", 0, element, shape, pointer)
            if index in self.updated:  # the same memory: ScatterND then writes the pool in place
                binding.bind_output(CACHE_OUTPUT.format(index), "cpu", 0, element, shape, pointer)
        given = dict(zip(self.input_names, inputs, strict=True))
        for name in self.fed:
            array = np.ascontiguousarray(given[name].numpy())
            keep.append(array)
            binding.bind_cpu_input(name, array)
        for name in self.output_names:
            binding.bind_output(output_name(name, self.spec))
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        for index, value in zip(self.updated, outputs[: len(self.updated)]):
            cache = kv_cache[index]
            if value.data_ptr() != cache.data_ptr():  # ORT wrote elsewhere: copy the pool back
                cache.copy_(torch.from_numpy(value.numpy()))
                self.copied_back += cache.numel() * cache.element_size()
        return [torch.from_numpy(value.numpy()) for value in outputs[len(self.updated) :]]


def load_onnx(root: Path, files: dict[str, str], kind: str, spec: ProgramSpec, threads: int = 0) -> OnnxProgram:
    """The ONNX rendition of program `kind` of the core at `root`; OnnxUnavailable names the
    export flag where the core has none."""
    record = OnnxRecord.read(root, files)
    if record is None or kind not in record.programs:
        raise OnnxUnavailable(
            f"{root}: the core has no ONNX rendition of its {kind} program; re-export it with "
            f"`ignition export ... {EXPORT_FLAG}` (or serve it with the torch runtime)"
        )
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise OnnxUnavailable("onnxruntime is not installed: pip install 'flare[onnx]'") from exc
    rendition = record.programs[kind]
    return OnnxProgram(kind, spec, root / rendition.file, rendition.updated_caches, threads)


__all__ = [
    "CACHE_INPUT",
    "CACHE_OUTPUT",
    "EXPORT_FLAG",
    "ONNX_DIR",
    "ONNX_WEIGHTS",
    "OPSET",
    "RECORD",
    "OnnxProgram",
    "OnnxRecord",
    "OnnxRendition",
    "OnnxUnavailable",
    "load_onnx",
    "output_name",
]
