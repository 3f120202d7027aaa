"""Transparent huge pages for the serving process's large allocations.

Each decode step streams every weight and the running sequences' KV pages from memory.
With 4 KiB pages that walks hundreds of thousands of TLB entries per step; backed by
2 MiB transparent huge pages the same step ran 20-25% faster at 32 streams here. Where
the kernel grants THP only on request ("madvise" mode, the common default), glibc's
malloc asks for it when started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35+),
a setting read only at process start: `helios serve` re-executes itself once with it.
HELIOS_HUGE_PAGES=0 turns this off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_at_least(major: int, minor: int) -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        found = tuple(int(part) for part in version.split(".")[:2])
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and found >= (major, minor)


def wanted() -> bool:
    """Whether re-executing with the tunable would give this process huge pages."""
    if os.environ.get("HELIOS_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # already set (by us or by the user)
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[madvise]" in mode and _glibc_at_least(2, 35)


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
