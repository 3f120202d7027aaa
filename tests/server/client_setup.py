"""The real coding clients for the client tests: installed from npm into a cache once, and
configured by exactly the shell block `helios clients NAME` prints, in a fresh HOME.

The clients come from npm into FLARE_CLIENTS_CACHE (default ~/.cache/flare-clients); a test
is skipped only when node, npm or the npm registry is missing.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from serving import ROOT

INSTALL_TIMEOUT_S = 900


@dataclass(frozen=True)
class Client:
    package: str
    version: str
    command: str


CLIENTS = {
    "codex": Client("@openai/codex", "0.162.1", "codex"),
    "claude": Client("@anthropic-ai/claude-code", "2.1.296", "claude"),
    "opencode": Client("opencode-ai", "1.18.33", "opencode"),
}
CACHE = Path(os.environ.get("FLARE_CLIENTS_CACHE") or Path.home() / ".cache" / "flare-clients")
# What the printed configurations cannot say: OpenCode's fetches and update checks are environment-only.
QUIET = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}


def _runs(executable: Path) -> bool:
    if not executable.exists():
        return False
    try:
        return subprocess.run([str(executable), "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def _registry_reachable(npm: str) -> bool:
    """One quick ping (no retries: npm's own would spend minutes on an unreachable registry)."""
    try:
        ping = subprocess.run(
            [npm, "ping", "--fetch-retries=0", "--fetch-timeout=20000"], capture_output=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return False
    return ping.returncode == 0


def installed(client: Client) -> Path:
    """The client's executable, installed from npm into the cache on first use (the packages'
    install scripts link the platform binary that an optional dependency ships)."""
    if shutil.which("node") is None:
        pytest.skip(f"node is not installed, so {client.package}@{client.version} cannot run")
    home = CACHE / f"{client.command}-{client.version}"
    executable = home / "node_modules" / ".bin" / client.command
    if _runs(executable):
        return executable
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed, so {client.package}@{client.version} cannot be installed")
    if not _registry_reachable(npm):
        pytest.skip(f"the npm registry is unreachable, so {client.package}@{client.version} cannot be installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{client.command}-", dir=CACHE))
    try:
        result = subprocess.run(
            [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", f"{client.package}@{client.version}"],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        assert result.returncode == 0, f"npm install {client.package}@{client.version} failed:\n{result.stderr[-4000:]}"
        shutil.rmtree(home, ignore_errors=True)  # a broken earlier install
        staging.rename(home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert _runs(executable), f"{executable} does not run after installing {client.package}@{client.version}"
    return executable


def client_fixture(name: str):
    """A session fixture named `name`: that client's executable, installed once (skipping without npm):
    `codex = client_fixture("codex")` in a conftest or test module."""

    @pytest.fixture(scope="session", name=name)
    def executable() -> Path:
        return installed(CLIENTS[name])

    return executable


def configure(name: str, core: Path, url: str, api_key: str, home: Path) -> dict[str, str]:
    """Run the block `helios clients NAME` prints, in a fresh HOME; the environment to run the client in."""
    key_file = home.parent / "key"
    key_file.write_text(api_key + "\n")
    printed = subprocess.run(
        [sys.executable, "-m", "helios", "clients", name, str(core), "--url", url, "--api-key-file", str(key_file)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    # A bare environment: nothing of the caller's (API keys, client settings) reaches the client.
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8", **QUIET}
    subprocess.run(["bash", "-e"], input=printed.stdout, text=True, env=env, check=True, capture_output=True)
    return env


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
