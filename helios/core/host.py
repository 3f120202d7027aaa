"""What a compiled artifact needs from the machine that runs it.

A compiled step (AOTInductor) is machine code for the export host's instruction set, with
weights pre-packed in the layout oneDNN chose for that CPU. It runs only where the
instruction-set features that code generation and packing look at are the same, on the
same torch build; anywhere else helios serves the portable program instead.

Under FLARE_CPU_ISA (helios/cpu_isa.py: an AVX-512 host emulating an AVX2 one) the flags are
those of the emulated instruction set, so every fingerprint and host-cache key says so too.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import torch

from helios import cpu_isa
from helios.core.manifest import HostFingerprint

# /proc/cpuinfo flags that change Inductor's vector code or oneDNN's weight packing.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "asimd",
    "sve",
    "sve2",
)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo), less those FLARE_CPU_ISA emulates away;
    empty where they cannot be read."""
    return cpu_isa.visible_flags(_cpu_flags())


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / aarch64
            return frozenset(value.split())
    return frozenset()


def fingerprint() -> HostFingerprint:
    """This host, as a compiled artifact records it."""
    flags = cpu_flags()
    return HostFingerprint(
        machine=platform.machine(),
        isa=tuple(f for f in ISA_FLAGS if f in flags),
        torch_version=str(torch.__version__),
    )


def mismatch(recorded: HostFingerprint) -> str | None:
    """Why an artifact built on `recorded` cannot run here, or None when it can."""
    here = fingerprint()
    if recorded.machine != here.machine:
        return f"it was compiled for {recorded.machine}, this host is {here.machine}"
    if recorded.torch_version != here.torch_version:
        return f"it was compiled with torch {recorded.torch_version}, this host has {here.torch_version}"
    if recorded.isa != here.isa:
        missing = sorted(set(recorded.isa) - set(here.isa))
        extra = sorted(set(here.isa) - set(recorded.isa))
        detail = "; ".join(
            part
            for part in (
                f"this CPU lacks {', '.join(missing)}" if missing else "",
                f"this CPU adds {', '.join(extra)}" if extra else "",
            )
            if part
        )
        return f"its instruction set differs ({detail})"
    return None
