"""Ollama discovery (/api/tags, /api/show) driven by the official `ollama` client, raw bodies
checked against Ollama's OpenAPI schema."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
import yaml
from serving import API_KEY, SCHEMA_PATH, Server

from helios.core import Core
from helios.protocols import ollama as discovery_protocol
from helios.protocols.models import identity

OLLAMA_SCHEMA = SCHEMA_PATH.parent / "ollama-openapi.yaml"


@pytest.fixture(scope="module")
def client(server: Server, monkeypatch_module) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("OLLAMA_API_KEY", raising=False)  # the client would send it when no header is set
        yield patch


@pytest.fixture(scope="module")
def schemas() -> dict:
    return yaml.safe_load(OLLAMA_SCHEMA.read_text())


def _validate(schemas: dict, name: str, body: dict) -> None:
    jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": schemas["components"]}
    ).validate(body)


def test_list_reports_the_loaded_model(server: Server, client: ollama.Client, schemas: dict) -> None:
    listing = client.list()
    assert len(listing.models) == 1
    entry = listing.models[0]
    assert entry.model == server.get("/v1/models").json()["data"][0]["id"] == "tiny-alias"
    assert entry.size == 0 and entry.modified_at.year == 1
    assert re.fullmatch(r"[0-9a-f]{64}", entry.digest)
    details = entry.details
    assert (details.format, details.family, details.families, details.parameter_size, details.quantization_level) == (
        "flare",
        "",
        [],
        "",
        "",
    )
    raw = server.get("/api/tags").json()
    _validate(schemas, "ListResponse", raw)
    assert raw["models"][0]["name"] == "tiny-alias" and raw["models"][0]["modified_at"] == "0001-01-01T00:00:00Z"


@pytest.mark.parametrize("name", ["tiny-alias", "tiny-llama", "org/tiny"])
def test_show_by_public_checkpoint_or_alias(server: Server, client: ollama.Client, schemas: dict, name: str) -> None:
    shown = client.show(name)
    assert shown.capabilities == ["completion"]  # a text core without tool or reasoning parsers
    card = server.get("/v1/models").json()["data"][0]
    assert shown.modelinfo == {
        "general.name": shown.modelinfo["general.name"],
        "flare.context_length": card["max_model_len"],
        "flare.vocab_size": card["flare"]["vocab_size"],
        "flare.weights_dtype": card["flare"]["precision"]["weights"],
        "flare.compute_dtype": card["flare"]["precision"]["compute"],
        "flare.kv_cache_dtype": card["flare"]["precision"]["kv_cache"],
    }
    assert shown.modelinfo["general.name"] and shown.details.format == "flare"
    assert shown.template is None and shown.modelfile is None  # templates are not exposed
    raw = server.post("/api/show", {"model": name})
    _validate(schemas, "ShowResponse", raw.json())
    assert server.post("/api/show", {"model": name, "verbose": True}).json() == raw.json()


def test_show_rejects_bad_names(server: Server, client: ollama.Client) -> None:
    empty = server.post("/api/show", {"model": ""})  # the client refuses to send an empty name itself
    assert empty.status_code == 400 and "empty" in empty.json()["error"]
    for body in (
        {},
        {"model": None},
        {"model": 7},
        {"model": ["tiny-alias"]},
        {"model": "tiny-alias", "verbose": "yes"},
    ):
        response = server.post("/api/show", body)
        assert response.status_code == 400, body
        assert isinstance(response.json()["error"], str) and response.json()["error"]
    with pytest.raises(ollama.ResponseError) as unknown:
        client.show("llama3:latest")
    assert unknown.value.status_code == 404 and "llama3:latest" in unknown.value.error


def test_show_takes_uncompressed_json_only(server: Server) -> None:
    body = gzip.compress(json.dumps({"model": "tiny-alias"}).encode())
    response = httpx.post(
        server.url + "/api/show", content=body, timeout=30, headers={**server.auth(), "content-encoding": "gzip"}
    )
    assert response.status_code == 415 and "identity" in response.json()["error"]
    malformed = httpx.post(server.url + "/api/show", content=b'{"model": ', headers=server.auth(), timeout=30)
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]


def test_discovery_needs_the_key(server: Server, monkeypatch_module) -> None:
    anonymous = ollama.Client(host=server.url)
    for call in (anonymous.list, lambda: anonymous.show("tiny-alias")):
        with pytest.raises(ollama.ResponseError) as failure:
            call()
        assert failure.value.status_code == 401
    wrong = httpx.get(server.url + "/api/tags", headers={"authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


def test_capabilities_and_digest_follow_the_core(tiny_core: Path, qwen3_core: Path) -> None:
    tiny = Core.open(tiny_core, verify_checksums=False).manifest
    qwen = Core.open(qwen3_core, verify_checksums=False).manifest
    assert discovery_protocol.capabilities(tiny) == ("completion",)
    assert discovery_protocol.capabilities(qwen) == ("completion", "tools", "thinking")
    base = discovery_protocol.discovery(identity(tiny, ("a",), created=1), tiny, 256)
    assert discovery_protocol.discovery(identity(tiny, ("a",), created=2), tiny, 256).digest == base.digest
    assert discovery_protocol.discovery(identity(tiny, ("b",), created=1), tiny, 256).digest != base.digest
    assert discovery_protocol.discovery(identity(tiny, ("a",), created=1), tiny, 128).digest != base.digest
    assert discovery_protocol.discovery(identity(qwen, ("a",), created=1), qwen, 256).digest != base.digest
