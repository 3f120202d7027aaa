"""The attention and sparse families' Triton kernels compile for an H100/H200 (sm_90) down to a cubin
on this machine without a GPU (tests.cuda.sm90_launches, in a subprocess: this process runs the
kernels under the interpreter). A sample in CI, every launch with FLARE_SLOW_TESTS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
NVIDIA = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (NVIDIA / "ptxas").exists(), reason="this triton wheel has no ptxas")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    groups = ["attention", "sparse"] if os.environ.get("FLARE_SLOW_TESTS") else ["sample"]
    run = subprocess.run(
        [sys.executable, "-m", "tests.cuda.sm90_paged_launches", *groups],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, "\n".join(lines) + run.stderr[-3000:]
    assert len(lines) >= 3 and all(line.startswith("ok ") for line in lines), lines
