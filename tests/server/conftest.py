"""Server fixtures: a real helios server in a subprocess, shared by the tests that use it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import API_KEY, SCHEMA_PATH, Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny core (with prompt logprobs) behind bearer auth."""
    instance = start_server(
        tiny_core,
        tmp_path_factory.mktemp("srv"),
        api_key=API_KEY,
        kv_pages=2048,
        max_concurrency=128,
        aliases=["tiny-alias", "org/tiny"],
    )
    yield instance
    stop_server(instance)


@pytest.fixture(scope="session")
def openai_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())
