"""An in-process helios server (uvicorn in a thread) whose model writes scripted tokens."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from support import ScriptedExecutor

from helios.config import ServerConfig
from helios.server.app import create_app
from helios.server.state import build_state


@dataclass
class Exchange:
    """One HTTP request as the client sent it and the response helios sent back (bytes grow
    while they travel)."""

    method: str
    path: str
    body: bytearray = field(default_factory=bytearray)
    status: int | None = None  # None until the response starts
    response: bytearray = field(default_factory=bytearray)  # the body as sent: JSON, or SSE frames


class ScriptedServer:
    def __init__(self, url: str, state, executor: ScriptedExecutor, exchanges: list[Exchange]) -> None:
        self.url = url
        self.state = state
        self.executor = executor
        self.http = httpx.Client(base_url=url, timeout=60)
        self.prompts: list[str | None] = []  # every prepared prompt's text, in preparation order
        self.exchanges = exchanges  # every HTTP request, in arrival order

    def last_prompt(self) -> str | None:
        return self.prompts[-1] if self.prompts else None

    def say(self, *texts: str) -> None:
        """Queue what the model writes next. Each text is tokenized on its own, so a special
        token spelling split across texts is written as ordinary pieces, not as the token."""
        tokenizer = self.state.frontend.tokenizer
        self.executor.script([t for text in texts for t in tokenizer.encode(text, add_special_tokens=False).ids])

    def follow(self, policy: Callable[[str], str]) -> None:
        """Once the queued scripts are used up, the model writes policy(prompt text) for each
        request: the prompt is decoded from its token ids, special tokens spelled out."""
        tokenizer = self.state.frontend.tokenizer

        def script(request) -> list[int]:
            text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
            return tokenizer.encode(policy(text), add_special_tokens=False).ids

        self.executor.policy = script

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)


@contextmanager
def scripted_app(core: Path, **settings):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    state = build_state(core, ServerConfig(**{"kv_pages": 256, **settings}))
    engine = state.client.engine
    executor = ScriptedExecutor(engine.executor, eos_id=state.core.manifest.tokenizer.eos_token_ids[0])
    engine.executor = executor
    app = create_app(state)
    exchanges: list[Exchange] = []

    async def recording(scope, receive, send):  # a test hook: every exchange as it went over the wire
        if scope["type"] != "http":
            return await app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"])
        exchanges.append(exchange)

        async def received():
            message = await receive()
            if message["type"] == "http.request":
                exchange.body.extend(message.get("body", b""))
            return message

        async def sent(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response.extend(message.get("body", b""))
            await send(message)

        return await app(scope, received, sent)

    server = uvicorn.Server(uvicorn.Config(recording, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for the socket to listen, not for a result
    scripted = ScriptedServer(f"http://127.0.0.1:{port}", state, executor, exchanges)
    prepare = state.frontend.prompt

    def recorded(*args, **kwargs):  # a test hook: the rendered prompt the request was given
        prepared = prepare(*args, **kwargs)
        scripted.prompts.append(prepared.text)
        return prepared

    state.frontend.prompt = recorded
    try:
        yield scripted
    finally:
        server.should_exit = True
        thread.join(timeout=10)
