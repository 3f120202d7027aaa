"""When `helios serve` asks glibc for transparent huge pages, and how the KV pool follows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helios import hugepages
from helios.core import program


@pytest.fixture
def linux_with_thp(monkeypatch: pytest.MonkeyPatch, tmp_path):
    def setup(mode: str = "always [madvise] never", glibc: str = "glibc 2.36", speedup: float = 2.0) -> None:
        thp = tmp_path / "enabled"
        thp.write_text(mode + "\n")
        monkeypatch.setattr(hugepages, "_THP_MODE", thp)
        monkeypatch.setattr(hugepages.os, "confstr", lambda name: glibc)
        monkeypatch.setattr(hugepages.sys, "platform", "linux")
        monkeypatch.setattr(hugepages, "measured_speedup", lambda: speedup)

    for name in ("HELIOS_HUGE_PAGES", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return setup


@pytest.mark.parametrize(
    ("env", "mode", "glibc", "speedup", "expected"),
    [
        ({}, "always [madvise] never", "glibc 2.36", 1.3, True),
        ({}, "always [madvise] never", "glibc 2.36", 1.08, False),  # reads barely faster: 4 KiB pages fault cheaper
        ({"HELIOS_HUGE_PAGES": "1"}, "always [madvise] never", "glibc 2.36", 1.0, True),  # forced, not measured
        ({"HELIOS_HUGE_PAGES": "0"}, "always [madvise] never", "glibc 2.36", 2.0, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "always [madvise] never", "glibc 2.36", 2.0, False),
        ({}, "[always] madvise never", "glibc 2.36", 2.0, False),  # the kernel already backs malloc with THP
        ({}, "always madvise [never]", "glibc 2.36", 2.0, False),
        ({}, "always [madvise] never", "glibc 2.31", 2.0, False),  # the tunable is newer
    ],
)
def test_wanted(
    monkeypatch: pytest.MonkeyPatch, linux_with_thp, env: dict, mode: str, glibc: str, speedup: float, expected: bool
) -> None:
    linux_with_thp(mode, glibc, speedup)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hugepages.wanted() is expected


def test_the_measurement_is_kept_per_host(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(hugepages, "_probe", lambda: calls.append(1) or ((0.08, 0.013), (0.010, 0.011)))
    assert hugepages.measured_speedup() == pytest.approx(1.1)
    assert hugepages.measured_speedup() == pytest.approx(1.1)
    assert len(calls) == 1  # the second start reads the host cache


def test_the_probe_measures_both_page_sizes() -> None:
    (huge_fault, small_fault), (huge_read, small_read) = hugepages._probe()
    assert min(huge_fault, small_fault, huge_read, small_read) > 0


@pytest.mark.parametrize("tunables", ["", "glibc.malloc.hugetlb=1"])
def test_the_kv_pool_is_zeroed_mapped_memory(monkeypatch: pytest.MonkeyPatch, tunables: str) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    pool = program._zeros((64, 16, 3, 8), torch.bfloat16)
    assert pool.shape == (64, 16, 3, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any()
    pool[3].fill_(2.0)
    assert pool.sum().item() == 2.0 * 16 * 3 * 8
    assert program._zeros((0, 4), torch.float32).shape == (0, 4)


def test_freed_memory_is_kept_where_glibc_allows() -> None:
    """keep_freed_memory applies both malloc settings on Linux with glibc (run apart: mallopt is
    process-wide); what it saves is measured by the benchmarks (docs/performance.md)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt is a Linux matter")
    script = "from helios import hugepages; print(hugepages.keep_freed_memory())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == "True"


def test_malloc_settings_given_by_the_user_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert hugepages.keep_freed_memory() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert hugepages.keep_freed_memory() is False
