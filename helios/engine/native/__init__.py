"""helios' native CPU kernels (the .cpp sources here, common.h lists them): built once per host,
loaded at engine start.

The Python kernels of the flare:: ops gather a decode row's whole history into a padded copy
and run SDPA over it under a mask, every layer; at 32 decode rows that is as much time as all
the model's matrix products. `flare_native::decode_attention` reads the paged cache in place.

Once loaded it also holds the CPU slot of flare::paged_attention and flare::write_kv (decode
rows in place, bfloat16 chunks on its own kernel, the rest handed to helios' Python kernels),
and CompiledRunner runs a compiled step as an op, so the GIL is released while it runs.

The library is compiled on the serving host (`g++ -O3 -march=native` against the installed
torch, each source in parallel, then linked) into the cache directory, keyed by the sources,
compiler flags, torch version and CPU flags, so it is built on first use (under a minute) and
loaded in milliseconds after that; `ignition export` and `helios serve` build it ahead of the
first request. Under FLARE_CPU_ISA=avx2 (helios/cpu_isa.py) it is compiled for Haswell instead:
no AVX-512 kernels, as on an AVX2 host. The AVX2 linear (linear_avx2.cpp) is compiled without
AVX-512 on every x86-64 host, so an AVX-512 machine runs (and tests) what an AVX2 one runs. Where no C++ compiler exists or the build
fails, helios says why once and keeps the Python kernels (same results, slower); setting
FLARE_NATIVE_KERNELS=0 does the same on purpose.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from helios import cpu_isa
from helios.core import hostcache
from helios.core.host import cpu_flags

log = logging.getLogger("helios.engine")

DIRECTORY = Path(__file__).parent
SOURCES = tuple(sorted(DIRECTORY.glob("*.cpp")))
HEADERS = tuple(sorted(DIRECTORY.glob("*.h")))
# Per-source flags on x86-64: the AVX2 kernels are built without AVX-512 whatever the host has, so
# an AVX-512 host runs (and tests) the code an AVX2 host runs.
# The quantized linears are compiled without contracting a product and a sum into one fused
# multiply-add, so that each weight is exactly helios.core.quant.dequantize's value (linear_q.h).
_SOURCE_FLAGS = {
    "linear_avx2.cpp": ("-mno-avx512f",),
    "attention_avx2.cpp": ("-mno-avx512f",),
    "linear_q.cpp": ("-ffp-contract=off",),
    "linear_q_avx2.cpp": ("-mno-avx512f", "-ffp-contract=off"),
    "linear_qa.cpp": ("-ffp-contract=off",),
    "linear_qa_avx2.cpp": ("-mno-avx512f", "-ffp-contract=off"),
}
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "reason": why not


def enabled_by_environment() -> bool:
    return os.environ.get("FLARE_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _march() -> str:
    isa = cpu_isa.requested()
    return f"-march={cpu_isa.MARCH[isa]}" if isa else "-march=native"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _key() -> str:
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(" ".join(_flags()).encode() + repr(sorted(_SOURCE_FLAGS.items())).encode())
    return digest.hexdigest()[:24]


def library_path() -> Path:
    return hostcache.directory() / "native" / f"helios_kernels-{_key()}.so"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3",
        _march(),
        "-fopenmp",
        "-fPIC",
        "-std=c++17",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]


def _compile_command(compiler: str, source: Path, output: Path) -> list[str]:
    extra = _SOURCE_FLAGS.get(source.name, ()) if _x86() else ()
    return [compiler, *_flags(), *extra, "-c", str(source), "-o", str(output)]


def _link_command(compiler: str, objects: list[Path], output: Path) -> list[str]:
    root = Path(torch.__file__).parent
    return [
        compiler,
        "-shared",
        "-fopenmp",
        *map(str, objects),
        "-o",
        str(output),
        f"-L{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{root / 'lib'}",
    ]


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr.strip()[-2000:]}")


def build() -> Path:
    """The library for this host, compiled now unless the cache holds it (raises on failure)."""
    path = library_path()
    if path.exists():
        return path
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found; install one (e.g. apt install g++) for the fast kernels")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # one build at a time across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        log.info("building helios' native CPU kernels for this host (once; cached in %s)", path.parent)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            staged = Path(scratch) / path.name
            objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
            with ThreadPoolExecutor(max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
                for done in [
                    pool.submit(_run, _compile_command(compiler, source, obj), f"compiling {source.name}")
                    for source, obj in zip(SOURCES, objects)
                ]:
                    done.result()
            _run(_link_command(compiler, objects, staged), "linking the native kernels")
            os.replace(staged, path)
    return path


def load() -> bool:
    """Load the native kernels into torch (building them if needed); False, once logged, if not."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        if not enabled_by_environment():
            _state.update(loaded=False, reason="FLARE_NATIVE_KERNELS=0")
            return False
        try:
            torch.ops.load_library(str(build()))
            torch.ops.flare_native.decode_attention  # the library registered its ops  # noqa: B018
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            _state.update(loaded=False, reason=str(exc))
            log.warning("native CPU kernels unavailable, using the Python kernels: %s", exc)
            return False
        # The library now serves the CPU slot of flare::paged_attention and flare::write_kv and
        # hands what it does not cover to the Python kernels.
        from helios.engine.kernels import attention as kernels

        kernels.register_fallbacks()
        _state["loaded"] = True
        return True


def loaded() -> bool:
    return bool(_state.get("loaded"))


def status() -> str:
    """For the startup line: 'native' or why not."""
    if loaded():
        return "native"
    return f"python ({_state['reason']})" if "reason" in _state else "python"


def keep_packed(caches: list[torch.Tensor]) -> int:
    """Have the tile attention kernel keep every full page of these (keys, values) pairs (k0, v0,
    k1, v1, ...) packed as it reads them (packed_pages.cpp), where it can: bfloat16 CPU caches on
    an AVX512-BF16 build. Returns how many pairs are kept. Whoever writes such pages other than
    through flare::write_kv says so with forget_packed."""
    if not loaded():
        return 0
    return sum(bool(torch.ops.flare_native.keep_packed(k, v)) for k, v in zip(caches[0::2], caches[1::2]))


def forget_packed(caches: list[torch.Tensor], pages: torch.Tensor) -> None:
    """These pages of these caches were written other than through flare::write_kv: their packed
    copies are stale (a no-op for caches not kept)."""
    if loaded():
        for cache in caches:
            torch.ops.flare_native.forget_packed(cache, pages)


class CompiledRunner:
    """An AOTInductor shared object run through the native library: as torch's own runner, but
    the step runs with the GIL released (the server's event loop streams meanwhile)."""

    def __init__(self, path: str) -> None:
        self._step = torch.classes.flare_native.CompiledStep(path)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return torch.ops.flare_native.run_compiled(self._step, inputs)
