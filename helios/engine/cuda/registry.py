"""Installs helios' Triton kernels for every flare:: op into the dispatcher's CUDA slot."""

from __future__ import annotations

from importlib import import_module

import torch

# The op-family modules of helios.engine.cuda; each installs its kernels with register(library).
FAMILIES = ("attention", "sparse", "moe", "recurrent")
_library: torch.library.Library | None = None


def register() -> None:
    """Install the CUDA kernels of every flare:: op (idempotent; needs triton importable)."""
    global _library
    if _library is None:
        library = torch.library.Library("flare", "IMPL")  # kept alive: dropping it unregisters
        for family in FAMILIES:
            import_module(f"{__package__}.{family}").register(library)
        _library = library
