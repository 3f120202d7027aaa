"""Installs helios' CPU kernels for every flare:: op into the dispatcher, once per process."""

from __future__ import annotations

import torch

from helios.engine import native
from helios.engine.kernels import (
    attention,
    bidirectional,
    block_sparse,
    deepseek_v4,
    gated_delta,
    glm5_next,
    mamba,
    moe,
    recurrent,
    sinks,
    sparse,
)

# Every op family's kernels, each module installing its own (register(library)).
FAMILIES = (
    attention,
    moe,
    bidirectional,
    block_sparse,
    sparse,
    deepseek_v4,
    recurrent,
    mamba,
    gated_delta,
    glm5_next,
    sinks,
)
_library: torch.library.Library | None = None


def register() -> None:
    """Install helios' CPU kernels (idempotent).

    They go straight into the dispatcher's CPU slot rather than through
    torch.library.register_kernel, whose wrapper imports torch._dynamo on its first call
    (over a second, paid by the first request of a compiled step) and costs microseconds on
    every call. The portable programs call the kernels directly anyway (graph.simplify); the
    compiled step reaches them through the dispatcher. Where the native library loads, it
    holds the CPU slot of flare::paged_attention and flare::write_kv itself (a decode step then
    runs without the GIL) and hands the steps it does not cover to the kernels here.
    """
    global _library
    if _library is None:
        native.load()  # before any step runs, so every step of this process uses the same kernels
        library = torch.library.Library("flare", "IMPL")  # kept alive: dropping it unregisters
        for family in FAMILIES:
            family.register(library)
        _library = library
