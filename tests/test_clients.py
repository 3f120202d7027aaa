"""`helios clients`: the configurations it prints carry the core's limits and helios' address,
and the shell block writes exactly the client files docs/clients.md describes."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helios.cli import app
from helios.clients import codex_catalog, output_limit, target
from helios.config import ServerConfig
from helios.core import Core


@pytest.fixture(scope="module")
def manifest(tiny_core: Path):
    return Core.open(tiny_core, verify_checksums=False).manifest


def _print(*args: str) -> str:
    result = CliRunner().invoke(app, ["clients", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _write(block: str, home: Path) -> None:
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    subprocess.run(["bash", "-e"], input=block, text=True, env=env, check=True, capture_output=True)


def test_output_limit_leaves_room_for_the_prompt() -> None:
    assert output_limit(8192, None) == 1024
    assert output_limit(1 << 20, None) == 32000
    assert output_limit(8192, 300) == 300
    assert output_limit(4, None) == 1


def test_target_follows_the_serving_configuration(manifest) -> None:
    plain = target(manifest, ServerConfig())
    assert (plain.url, plain.model, plain.context, plain.api_key) == (
        "http://127.0.0.1:8000",
        manifest.public_id,
        manifest.limits.max_model_len,
        None,
    )
    served = target(
        manifest, ServerConfig(host="0.0.0.0", port=9001, aliases=("", "local"), api_key="k", default_max_tokens=64)
    )
    assert (served.url, served.model, served.api_key, served.output) == ("http://127.0.0.1:9001", "local", "k", 64)
    assert target(manifest, ServerConfig(), "http://host:8080/v1/").url == "http://host:8080"


def test_codex_profile_disables_hosted_search_and_catalogs_the_core(tiny_core: Path, manifest, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-1\n")
    _write(_print("codex", str(tiny_core), "--url", "http://127.0.0.1:9/", "--api-key-file", str(key)), tmp_path)
    profile = tomllib.loads((tmp_path / ".codex" / "flare.config.toml").read_text())
    assert profile["web_search"] == "disabled" and profile["model_provider"] == "flare"
    assert profile["model_providers"]["flare"] == {
        "name": "Flare",
        "base_url": "http://127.0.0.1:9/v1",
        "wire_api": "responses",
        "experimental_bearer_token": "sk-1",
    }
    assert profile["model_catalog_json"] == "flare-models.json" and profile["analytics"] == {"enabled": False}
    catalog = json.loads((tmp_path / ".codex" / "flare-models.json").read_text())
    (model,) = catalog["models"]
    assert model["slug"] == profile["model"] == manifest.public_id
    assert model["context_window"] == manifest.limits.max_model_len
    assert model["apply_patch_tool_type"] == "freeform" and model["input_modalities"] == ["text"]
    assert catalog == codex_catalog(target(manifest, ServerConfig(), "http://127.0.0.1:9"))


def test_claude_settings_name_helios_and_the_core_limits(tiny_core: Path, manifest, tmp_path: Path) -> None:
    _write(_print("claude", "--core", str(tiny_core)), tmp_path)
    env = json.loads((tmp_path / ".claude" / "flare.json").read_text())["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000" and env["ANTHROPIC_API_KEY"] == "none"
    assert {env[k] for k in env if k.endswith("_MODEL")} == {manifest.public_id}
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(manifest.limits.max_model_len)
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(output_limit(manifest.limits.max_model_len, None))
    assert env["DISABLE_TELEMETRY"] == env["DISABLE_AUTOUPDATER"] == "1"


def test_opencode_provider_declares_context_and_output(tiny_core: Path, manifest, tmp_path: Path) -> None:
    _write(_print("opencode", str(tiny_core), "--url", "http://127.0.0.1:8123"), tmp_path)
    config = json.loads((tmp_path / ".config" / "opencode" / "flare.json").read_text())
    provider = config["provider"]["flare"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"] == {
        "baseURL": "http://127.0.0.1:8123/v1"
    }
    limit = provider["models"][manifest.public_id]["limit"]
    assert limit == {
        "context": manifest.limits.max_model_len,
        "output": output_limit(manifest.limits.max_model_len, None),
    }
    assert config["model"] == f"flare/{manifest.public_id}" and config["autoupdate"] is False


def test_unknown_clients_and_missing_cores_are_refused(tiny_core: Path, tmp_path: Path) -> None:
    assert CliRunner().invoke(app, ["clients", "cursor", str(tiny_core)]).exit_code == 2
    assert CliRunner().invoke(app, ["clients", "codex"]).exit_code == 2
    missing = CliRunner().invoke(app, ["clients", "codex", str(tmp_path)])
    assert missing.exit_code == 2 and "not a core" in missing.output
