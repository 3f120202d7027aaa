"""The tree is formatted and linted by ruff (configured in pyproject.toml), as CI checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_the_tree_is_formatted() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_the_tree_passes_the_linter() -> None:
    result = _ruff("check", ".")
    assert result.returncode == 0, f"run `ruff check --fix .` and fix the rest:\n{result.stdout}{result.stderr}"


def test_no_module_is_over_800_lines() -> None:
    """STYLE.md: past 800 lines a module is split by responsibility (never by mixin)."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    long = {path: n for path in tracked if (n := len((ROOT / path).read_text().splitlines())) > 800}
    assert long == {}, f"split these modules by responsibility: {long}"
