"""Starting real helios servers in subprocesses, and reading their responses."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT.parent / "shared" / "spec" / "external" / "openai-openapi.nullable-fixed.json"
API_KEY = "test-key-123"


@dataclass
class Server:
    url: str
    key: str | None
    process: subprocess.Popen

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.auth(), timeout=60, **kwargs)

    def post(self, path: str, body: object, **kwargs) -> httpx.Response:
        headers = {**self.auth(), **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kwargs)

    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json", timeout=30).json()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(core: Path, tmp: Path, **settings) -> Server:
    port = _free_port()
    key = settings.pop("api_key", None)
    lines = ["[server]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    if key:
        lines.append(f"api_key = {json.dumps(key)}")
    config = tmp / f"helios-{port}.toml"
    config.write_text("\n".join(lines) + "\n")
    log = open(tmp / f"helios-{port}.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "helios",
            "serve",
            str(core),
            "--config",
            str(config),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
        cwd=ROOT,
    )
    server = Server(f"http://127.0.0.1:{port}", key, process)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"helios exited: {(tmp / f'helios-{port}.log').read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # waiting for the port to open, not for a result
    process.kill()
    raise RuntimeError("helios did not become healthy")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()


@contextlib.contextmanager
def running_server(core: Path, tmp: Path, **settings) -> Iterator[Server]:
    """start_server(core, tmp, **settings) for the `with` block, stopped when it ends."""
    server = start_server(core, tmp, **settings)
    try:
        yield server
    finally:
        stop_server(server)


def schema_validator(spec: dict, name: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    return jsonschema.Draft202012Validator(schema)


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, in order (comments skipped)."""
    events = []
    for block in response.text.split("\n\n"):
        data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if data:
            events.append("\n".join(data))
    return events
