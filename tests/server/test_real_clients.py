"""The real coding clients, at the versions docs/clients.md qualifies, configured by exactly what
`helios clients` prints, each answer one short prompt from a live helios on the SmolLM2 core.

The clients come from npm into a cache (client_setup.py); a test is skipped only when node,
npm or its registry cannot be reached.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from client_setup import configure, json_lines
from serving import API_KEY, Server

PROMPT = "Say hello in one short sentence."
CLIENT_TIMEOUT_S = 300


def run_client(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    assert result.returncode == 0, (
        f"{argv[0]} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


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
    env = configure("codex", smollm2_core, smol.url, API_KEY, home)
    before = _completed(smol)
    result = run_client(
        [str(codex), "exec", "--profile", "flare", "--skip-git-repo-check", "--json", PROMPT], env, repo
    )
    answers = [
        e["item"]["text"]
        for e in json_lines(result.stdout)
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert answers and answers[-1].strip(), result.stdout
    assert _completed(smol) > before


_SLOW = pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")


@pytest.mark.parametrize(
    "mode",
    [pytest.param(["--bare"], id="bare"), pytest.param([], id="normal", marks=[pytest.mark.slow, _SLOW])],
)  # CI samples the bare session; the normal one (Claude Code's full system prompt) runs with the flag
def test_claude_print(
    claude: Path, smol: Server, smollm2_core: Path, workspace: tuple[Path, Path], mode: list[str]
) -> None:
    home, repo = workspace
    env = configure("claude", smollm2_core, smol.url, API_KEY, home)
    before = _completed(smol)
    settings = home / ".claude" / "flare.json"
    result = run_client(
        [str(claude), *mode, "--settings", str(settings), "-p", PROMPT, "--output-format", "json"], env, repo
    )
    final = json_lines(result.stdout)[-1]
    assert final["type"] == "result" and final["is_error"] is False and final["result"].strip(), final
    assert _completed(smol) > before


def test_opencode_run(opencode: Path, smol: Server, smollm2_core: Path, workspace: tuple[Path, Path]) -> None:
    home, repo = workspace
    env = configure("opencode", smollm2_core, smol.url, API_KEY, home)
    env["OPENCODE_CONFIG"] = str(home / ".config" / "opencode" / "flare.json")
    before = _completed(smol)
    result = run_client([str(opencode), "run", "--title", "flare", "--format", "json", PROMPT], env, repo)
    texts = [e["part"]["text"] for e in json_lines(result.stdout) if e.get("type") == "text"]
    assert texts and texts[-1].strip(), result.stdout
    assert _completed(smol) > before
