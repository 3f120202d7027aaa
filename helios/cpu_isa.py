"""FLARE_CPU_ISA: serve on this CPU as if it had a smaller instruction set.

Most CPUs people own have AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores); helios
is built and tested on AVX-512 machines too. `FLARE_CPU_ISA=avx2` makes such a machine behave
as an AVX2 host for tests and benchmarks:

* helios' native kernels are compiled for Haswell (`-march=haswell`: AVX2, FMA, F16C, no
  AVX-512), so its AVX-512 kernels are absent and its AVX2 ones run;
* the host's feature flags (helios.core.host.cpu_flags), and with them every host fingerprint
  and cache key (measured kernel choices, thread policy, compiled-step matching), lose AVX-512
  and AMX;
* torch is told the same before it initialises: ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's kernels),
  ATEN_CPU_CAPABILITY=avx2 (ATen's and Inductor's vector code) and TORCHINDUCTOR_CPP_MARCH=haswell
  (Inductor's compiler flags). These are read once, when torch starts: `helios serve` applies
  them itself before importing torch (`apply`); any other process must have them in its
  environment from the start (`torch_environment`), as benchmarks/compare.py does for the
  servers it starts. Values you set yourself win.

Unset, empty or "native": the CPU as it is. Any other value is refused (ValueError).
This module imports nothing heavy, so it can run before torch is loaded.
"""

from __future__ import annotations

import os
import platform
import sys

ENV = "FLARE_CPU_ISA"
EMULATED = ("avx2",)
MARCH = {"avx2": "haswell"}
_TORCH_ENV = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "haswell"}
}
# /proc/cpuinfo flags a Haswell-class (AVX2 + FMA) CPU lacks: every AVX-512 and AMX extension,
# and the VEX forms of their newer instructions.
_ABSENT = {"avx2": ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")}


def requested() -> str | None:
    """The instruction set FLARE_CPU_ISA asks to emulate, or None for the CPU as it is."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in EMULATED:
        raise ValueError(f"{ENV}={value!r}: helios emulates only {', '.join(EMULATED)} (or 'native')")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"{ENV}={value}: an x86-64 instruction set, but this host is {platform.machine()}")
    return value


def torch_environment(isa: str | None = None) -> dict[str, str]:
    """The environment variables torch must start with to run as `isa` (default: FLARE_CPU_ISA's)."""
    isa = isa if isa is not None else requested()
    return dict(_TORCH_ENV.get(isa, {})) if isa else {}


def apply() -> None:
    """Put FLARE_CPU_ISA's torch settings into this process's environment (those not set already).
    They take effect only if torch has not been imported yet: a warning says so otherwise."""
    wanted = {k: v for k, v in torch_environment().items() if k not in os.environ}
    if wanted and "torch" in sys.modules:
        print(f"warning: {ENV}: torch is already loaded; set {', '.join(wanted)} before it starts", file=sys.stderr)
    os.environ.update(wanted)


def visible_flags(flags: frozenset[str], isa: str | None = None) -> frozenset[str]:
    """The CPU flags helios reckons with: all of them, or those the emulated instruction set has."""
    isa = isa if isa is not None else requested()
    if not isa:
        return flags
    return frozenset(f for f in flags if not f.startswith(_ABSENT[isa]))
