"""The real coding clients, at the versions docs/clients.md qualifies, configured by exactly what
`helios clients` prints, each answer one short prompt from a live helios on the SmolLM2 core.

The clients come from npm into a cache (FLARE_CLIENTS_CACHE, default ~/.cache/flare-clients),
installed once; a test is skipped only when npm or its registry cannot be reached.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving import API_KEY, ROOT, Server, start_server, stop_server

PROMPT = "Say hello in one short sentence."
CLIENT_TIMEOUT_S = 300
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
QUIET = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
         "OPENCODE_DISABLE_SHARE": "1"}  # fmt: skip


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
        ping = subprocess.run([npm, "ping", "--fetch-retries=0", "--fetch-timeout=20000"], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return ping.returncode == 0


def installed(client: Client) -> Path:
    """The client's executable, installed from npm into the cache on first use (the packages'
    install scripts link the platform binary that an optional dependency ships)."""
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
        result = subprocess.run([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                                 f"{client.package}@{client.version}"], capture_output=True, text=True,
                                timeout=INSTALL_TIMEOUT_S)  # fmt: skip
        assert result.returncode == 0, f"npm install {client.package}@{client.version} failed:\n{result.stderr[-4000:]}"
        shutil.rmtree(home, ignore_errors=True)  # a broken earlier install
        staging.rename(home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert _runs(executable), f"{executable} does not run after installing {client.package}@{client.version}"
    return executable


@pytest.fixture(scope="session")
def codex() -> Path:
    return installed(CLIENTS["codex"])


@pytest.fixture(scope="session")
def claude() -> Path:
    return installed(CLIENTS["claude"])


@pytest.fixture(scope="session")
def opencode() -> Path:
    return installed(CLIENTS["opencode"])


@pytest.fixture(scope="module")
def smol(smollm2_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = start_server(smollm2_core, tmp_path_factory.mktemp("clients-srv"), api_key=API_KEY)
    yield instance
    stop_server(instance)


def configure(name: str, smollm2_core: Path, server: Server, home: Path) -> dict[str, str]:
    """Run the block `helios clients NAME` prints, in a fresh HOME; the environment to run the client in."""
    key_file = home.parent / "key"
    key_file.write_text(API_KEY + "\n")
    printed = subprocess.run([sys.executable, "-m", "helios", "clients", name, str(smollm2_core), "--url", server.url,
                              "--api-key-file", str(key_file)], capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    # A bare environment: nothing of the caller's (API keys, client settings) reaches the client.
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8", **QUIET}
    subprocess.run(["bash", "-e"], input=printed.stdout, text=True, env=env, check=True, capture_output=True)
    return env


def run_client(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    home, repo = tmp_path / "home", tmp_path / "repo"
    home.mkdir()
    repo.mkdir()
    (repo / "README.md").write_text("A scratch project.\n")
    return home, repo


def _completed(server: Server) -> int:
    return server.metrics()["completed"]


def test_codex_exec(codex: Path, smol: Server, smollm2_core: Path, workspace: tuple[Path, Path]) -> None:
    home, repo = workspace
    env = configure("codex", smollm2_core, smol, home)
    before = _completed(smol)
    result = run_client([str(codex), "exec", "--profile", "flare", "--skip-git-repo-check", "--json", PROMPT], env, repo)
    answers = [e["item"]["text"] for e in _json_lines(result.stdout)
               if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]  # fmt: skip
    assert answers and answers[-1].strip(), result.stdout
    assert _completed(smol) > before


@pytest.mark.parametrize("mode", [["--bare"], []], ids=["bare", "normal"])
def test_claude_print(claude: Path, smol: Server, smollm2_core: Path, workspace: tuple[Path, Path],
                      mode: list[str]) -> None:  # fmt: skip
    home, repo = workspace
    env = configure("claude", smollm2_core, smol, home)
    before = _completed(smol)
    settings = home / ".claude" / "flare.json"
    result = run_client([str(claude), *mode, "--settings", str(settings), "-p", PROMPT, "--output-format", "json"], env, repo)
    final = _json_lines(result.stdout)[-1]
    assert final["type"] == "result" and final["is_error"] is False and final["result"].strip(), final
    assert _completed(smol) > before


def test_opencode_run(opencode: Path, smol: Server, smollm2_core: Path, workspace: tuple[Path, Path]) -> None:
    home, repo = workspace
    env = configure("opencode", smollm2_core, smol, home)
    env["OPENCODE_CONFIG"] = str(home / ".config" / "opencode" / "flare.json")
    before = _completed(smol)
    result = run_client([str(opencode), "run", "--title", "flare", "--format", "json", PROMPT], env, repo)
    texts = [e["part"]["text"] for e in _json_lines(result.stdout) if e.get("type") == "text"]
    assert texts and texts[-1].strip(), result.stdout
    assert _completed(smol) > before
