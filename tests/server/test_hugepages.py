"""When `helios serve` asks glibc for transparent huge pages."""

from __future__ import annotations

import pytest

from helios import hugepages


@pytest.mark.parametrize(("env", "mode", "glibc", "expected"), [
    ({}, "always [madvise] never", "glibc 2.36", True),
    ({"HELIOS_HUGE_PAGES": "0"}, "always [madvise] never", "glibc 2.36", False),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "always [madvise] never", "glibc 2.36", False),
    ({}, "[always] madvise never", "glibc 2.36", False),  # the kernel already backs malloc with THP
    ({}, "always madvise [never]", "glibc 2.36", False),
    ({}, "always [madvise] never", "glibc 2.31", False),  # the tunable is newer
])  # fmt: skip
def test_wanted(monkeypatch: pytest.MonkeyPatch, tmp_path, env: dict, mode: str, glibc: str, expected: bool) -> None:
    for name in ("HELIOS_HUGE_PAGES", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    thp = tmp_path / "enabled"
    thp.write_text(mode + "\n")
    monkeypatch.setattr(hugepages, "_THP_MODE", thp)
    monkeypatch.setattr(hugepages.os, "confstr", lambda name: glibc)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    assert hugepages.wanted() is expected
