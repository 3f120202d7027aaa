"""`[server] runtime = "onnxruntime"` (`helios serve --runtime onnxruntime`): the executor's
programs run as the core's ONNX renditions (`ignition export --onnx`) on ONNX Runtime's CPU
provider, through helios.core.onnx_program.OnnxProgram, which is called like the torch programs
(same named inputs and outputs, the KV pool updated in place through IO binding): the step and
scored-prefill programs, the vision program and the drafter's (mtp_draft.N) where the core has
them. Everything above the executor (scheduler, prefix cache, speculation, protocols) is
unchanged. The ONNX files hold their weights, so the executor loads the core's torch weights
only for a program left in torch (`OnnxPrograms.torch_kinds`: a vision or drafter program of a
core rendered before they were, which still runs on the torch runtime beside the others).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from helios.core import Core, CoreError
from helios.core.onnx_program import EXPORT_FLAG, OnnxProgram, OnnxRecord, load_onnx
from helios.core.program import SCORED_PREFILL, STEP, VISION

log = logging.getLogger("helios.engine")

TORCH = "torch"
ONNXRUNTIME = "onnxruntime"
RUNTIMES = (TORCH, ONNXRUNTIME)


@dataclass(frozen=True, slots=True)
class OnnxPrograms:
    """The executor's programs on ONNX Runtime, and the kinds the core has no rendition of."""

    step: OnnxProgram
    scored: OnnxProgram | None
    vision: OnnxProgram | None  # None: the core has no vision program, or it is in torch_kinds
    drafters: dict[str, OnnxProgram]  # the drafter kinds asked for that have a rendition
    torch_kinds: tuple[str, ...]  # vision / drafter kinds left to torch (they need the torch weights)


def load(core: Core, device: str, upcast: bool, scored: bool, drafters: tuple[str, ...] = ()) -> OnnxPrograms:
    """The core's programs' ONNX renditions, run with torch's thread count. CoreError (a startup
    error) where the core has none of its step or they cannot run here."""
    if device != "cpu":
        raise CoreError(
            f'[server] runtime = "{ONNXRUNTIME}" runs on the CPU only (ONNX Runtime\'s CPU provider), not {device}'
        )
    if upcast:
        raise CoreError(
            f'[server] runtime = "{ONNXRUNTIME}" runs float32 and float16 cores as exported; this '
            f"{core.manifest.weights.dtype} core would need an upcast: serve it with the torch runtime"
        )
    m = core.manifest
    if m.kv.dtype not in ("float32", "float16"):  # ONNX Runtime's bindings name no bfloat16 buffer
        raise CoreError(
            f'[server] runtime = "{ONNXRUNTIME}" binds float32 or float16 KV caches, not {m.kv.dtype}: '
            "serve this core with the torch runtime"
        )
    threads = torch.get_num_threads()

    def rendition(kind: str) -> OnnxProgram:
        return load_onnx(core.root, m.files, kind, m.programs[kind], threads)

    step = rendition(STEP)
    prefill = rendition(SCORED_PREFILL) if scored else None
    record = OnnxRecord.read(core.root, m.files)
    rendered = set(record.programs) if record is not None else set()
    extra = ((VISION,) if VISION in m.programs else ()) + drafters
    left = tuple(kind for kind in extra if kind not in rendered)
    if left:  # exported with --onnx before these programs were rendered
        log.warning(
            "the core has no ONNX rendition of its %s program(s): they run on the torch runtime, with the torch "
            "weights loaded beside the ONNX sessions; re-export the core with %s to run them on ONNX Runtime too",
            ", ".join(left),
            EXPORT_FLAG,
        )
    return OnnxPrograms(
        step=step,
        scored=prefill,
        vision=rendition(VISION) if VISION in extra and VISION not in left else None,
        drafters={kind: rendition(kind) for kind in drafters if kind not in left},
        torch_kinds=left,
    )


__all__ = ["EXPORT_FLAG", "ONNXRUNTIME", "RUNTIMES", "TORCH", "OnnxPrograms", "load"]
