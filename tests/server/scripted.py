"""An in-process helios app whose model writes scripted token sequences (see ScriptedExecutor)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from litestar.testing import TestClient

from helios.config import ServerConfig
from helios.server.app import create_app
from helios.server.state import build_state
from support import ScriptedExecutor


@contextmanager
def scripted_app(core: Path, **settings):
    state = build_state(core, ServerConfig(kv_pages=256, **settings))
    engine = state.client.engine
    executor = ScriptedExecutor(engine.executor, eos_id=state.core.manifest.tokenizer.eos_token_ids[0])
    engine.executor = executor
    tokenizer = state.frontend.tokenizer

    def say(*texts: str) -> None:
        """Queue what the model writes next. Each text is tokenized on its own, so a special
        token spelling split across texts is written as ordinary pieces, not as the token."""
        executor.script([t for text in texts for t in tokenizer.encode(text, add_special_tokens=False).ids])

    with TestClient(app=create_app(state), base_url="http://testserver.local") as client:
        client.say = say  # type: ignore[attr-defined]
        client.state = state  # type: ignore[attr-defined]
        yield client
