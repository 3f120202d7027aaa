"""Transparent huge pages for the serving process's large allocations, where they pay.

Each decode step streams every weight and the running sequences' KV pages from memory.
With 4 KiB pages that walks hundreds of thousands of TLB entries per step; on one host,
backed by 2 MiB transparent huge pages, the same step ran 20-25% faster at 32 streams.
On another (a 2-core VM) steps ran no faster on them (one-row decode 130 tok/s either way;
page-sized random reads 8-11% faster) while their first touch cost 6x more (80 ms per
64 MiB against 13 ms): every fresh allocation on the hot path paid for it, such as the
pool pages a host-store restore fills (a 4,000-token restore took 0.61 s instead of 0.32
s), and the weights at startup. So the choice is measured once per host
(`measured_speedup`, kept in the host cache): huge pages are used where page-sized random
reads over them are at least 15% faster than over 4 KiB pages.

Where the kernel grants THP only on request ("madvise" mode, the common default), glibc's
malloc asks for it when started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35+),
a setting read only at process start: `helios serve` re-executes itself once with it.
HELIOS_HUGE_PAGES=0 turns this off, HELIOS_HUGE_PAGES=1 turns it on without measuring.

Whatever the page size, `helios serve` also has malloc keep what a step frees for the next
step (keep_freed_memory), so that a step's large outputs do not fault in fresh pages each time.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
import time
from pathlib import Path

log = logging.getLogger("helios.server")

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_CACHE = "huge_pages"
_PROBE_MIB = 64
MIN_SPEEDUP = 1.15  # page-sized random reads at least this much faster on huge pages (see the docstring)


def _glibc_at_least(major: int, minor: int) -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        found = tuple(int(part) for part in version.split(".")[:2])
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and found >= (major, minor)


def wanted() -> bool:
    """Whether re-executing with the tunable would give this process huge pages."""
    if os.environ.get("HELIOS_HUGE_PAGES") == "0" or not sys.platform.startswith("linux"):
        return False
    if TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # already set (by us or by the user)
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    if not ("[madvise]" in mode and _glibc_at_least(2, 35)):
        return False
    return os.environ.get("HELIOS_HUGE_PAGES") == "1" or measured_speedup() >= MIN_SPEEDUP


def _host_key() -> str:
    try:
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    except OSError:
        cpu = ""
    return f"{platform.machine()}|{cpu}|{os.cpu_count()}|{platform.release()}"


def measured_speedup() -> float:
    """How much faster page-sized random reads run over huge pages than over 4 KiB pages on
    this host (measured once, then read from the host cache)."""
    from helios.core import hostcache

    key = _host_key()
    known = hostcache.get(_CACHE, key)
    if isinstance(known, dict) and isinstance(known.get("speedup"), (int, float)):
        return float(known["speedup"])
    try:
        (huge_fault, small_fault), (huge_read, small_read) = _probe()
    except (OSError, ValueError, AttributeError) as exc:  # no madvise here: keep 4 KiB pages
        log.debug("huge pages: not measured (%s)", exc)
        return 0.0
    speedup = small_read / huge_read
    hostcache.put(
        _CACHE,
        key,
        {"speedup": round(speedup, 4), "first_touch_ms": [round(huge_fault * 1e3, 1), round(small_fault * 1e3, 1)]},
    )
    log.debug(
        "huge pages: random reads %.2fx as fast, first touch %.0f ms against %.0f ms per %d MiB",
        speedup,
        huge_fault * 1e3,
        small_fault * 1e3,
        _PROBE_MIB,
    )
    return speedup


def _probe() -> tuple[tuple[float, float], tuple[float, float]]:
    """((first-touch seconds), (best seconds of a page-sized random gather)) over a region on
    huge pages and one on 4 KiB pages, in that order; the gathers alternate between them."""
    import torch

    regions = [mmap.mmap(-1, _PROBE_MIB << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    try:
        faults, rows = [], []
        for region, advice in zip(regions, (mmap.MADV_HUGEPAGE, mmap.MADV_NOHUGEPAGE)):
            region.madvise(advice)
            words = torch.frombuffer(region, dtype=torch.int64)
            started = time.perf_counter()
            words.fill_(1)
            faults.append(time.perf_counter() - started)
            rows.append(words.view(-1, 512))  # 4 KiB rows
        index = torch.randint(0, rows[0].shape[0], (rows[0].shape[0] // 4,), generator=torch.Generator().manual_seed(0))
        out = torch.zeros(len(index), 512, dtype=torch.int64)
        best = [float("inf"), float("inf")]
        for _ in range(7):
            for which, source in enumerate(rows):
                started = time.perf_counter()
                torch.index_select(source, 0, index, out=out)
                best[which] = min(best[which], time.perf_counter() - started)
        del words, rows
    finally:
        for region in regions:
            region.close()
    return (faults[0], faults[1]), (best[0], best[1])


def reexec_with_huge_pages() -> None:
    """Replace this process with the same command line, malloc asking for huge pages.

    Returns only when that is not wanted here.
    """
    if not wanted():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    env = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


# glibc's mallopt parameters, and what the serving process asks of them (keep_freed_memory)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_BYTES = 32 << 20  # allocations below this come from the heap (glibc's largest threshold)
_KEEP_BYTES = 512 << 20  # freed heap memory kept for reuse before any goes back to the system


def keep_freed_memory() -> bool:
    """Have malloc keep what a step frees for the next step, instead of handing it back to the
    system and faulting it in again (each page cleared by the kernel on first touch).

    A decode step allocates its outputs afresh (the logits alone are rows x vocabulary floats:
    12.6 MB at 64 rows of SmolLM2); glibc serves such sizes with their own mappings, or trims them
    off the heap once freed, so every step paid ~3,000 page faults at 64 rows (~1,200 still with
    glibc's self-adjusting thresholds). With allocations under 32 MiB served from the heap and up
    to 512 MiB of freed heap kept, the engine's steady state faults in almost nothing. Settings
    already given in GLIBC_TUNABLES or MALLOC_*_ variables win. Returns whether it applied."""
    if not sys.platform.startswith("linux") or not _glibc_at_least(2, 17):
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{name}" in tunables for name in ("mmap_threshold", "trim_threshold")) or any(
        f"MALLOC_{name}_" in os.environ for name in ("MMAP_THRESHOLD", "TRIM_THRESHOLD")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
