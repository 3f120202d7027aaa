"""`[server] runtime = "onnxruntime"` (`helios serve --runtime onnxruntime`): the executor's step
programs run as the core's ONNX renditions (`ignition export --onnx`) on ONNX Runtime's CPU
provider, through helios.core.onnx_program.OnnxProgram, which is called like the torch programs
(same named inputs and outputs, the KV pool updated in place through IO binding). Everything
above the executor (scheduler, prefix cache, speculation, protocols) is unchanged; a core's
drafter and vision programs stay torch programs.
"""

from __future__ import annotations

import torch

from helios.core import Core, CoreError
from helios.core.onnx_program import EXPORT_FLAG, OnnxProgram, load_onnx
from helios.core.program import SCORED_PREFILL, STEP

TORCH = "torch"
ONNXRUNTIME = "onnxruntime"
RUNTIMES = (TORCH, ONNXRUNTIME)


def load(core: Core, device: str, upcast: bool, scored: bool) -> tuple[OnnxProgram, OnnxProgram | None]:
    """The step (and scored-prefill) programs' ONNX renditions, run with torch's thread count.
    CoreError (a startup error) where the core has none or they cannot run here."""
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
    step = load_onnx(core.root, m.files, STEP, m.programs[STEP], threads)
    prefill = load_onnx(core.root, m.files, SCORED_PREFILL, m.programs[SCORED_PREFILL], threads) if scored else None
    return step, prefill


__all__ = ["EXPORT_FLAG", "ONNXRUNTIME", "RUNTIMES", "TORCH", "load"]
