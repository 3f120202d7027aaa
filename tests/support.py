"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a console entry point (`ignition ...` / `helios ...`) in a fresh process."""
    program, *rest = args
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", program, *rest], capture_output=True, text=True, env=full_env, cwd=ROOT)
