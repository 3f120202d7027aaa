"""Server fixtures: a real helios server in a subprocess, shared by the tests that use it, and the
real coding clients' executables (client_setup.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_setup import client_fixture
from scripted import ScriptedServer, scripted_app
from serving import API_KEY, SCHEMA_PATH, Server, running_server


@pytest.fixture(scope="session")
def server(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny core (with prompt logprobs) behind bearer auth."""
    with running_server(
        tiny_core,
        tmp_path_factory.mktemp("srv"),
        api_key=API_KEY,
        kv_pages=2048,
        max_concurrency=128,
        aliases=["tiny-alias", "org/tiny"],
    ) as instance:
        yield instance


@pytest.fixture(scope="module")
def smol_settings() -> dict[str, object]:
    """The [server] settings `smol` starts with besides its API key; a module overrides this
    fixture to change them."""
    return {}


@pytest.fixture(scope="module")
def smol(
    smollm2_core: Path, smol_settings: dict[str, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The SmolLM2 core behind bearer auth, one server per test module."""
    with running_server(smollm2_core, tmp_path_factory.mktemp("smol"), api_key=API_KEY, **smol_settings) as instance:
        yield instance


@pytest.fixture(scope="module")
def qwen3_app(qwen3_core: Path) -> Iterator[ScriptedServer]:
    """The tiny Qwen3 core served in process with a scripted model (scripted.py), one per test module."""
    with scripted_app(qwen3_core) as app:
        yield app


@pytest.fixture(scope="session")
def openai_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


codex = client_fixture("codex")
claude = client_fixture("claude")
opencode = client_fixture("opencode")
