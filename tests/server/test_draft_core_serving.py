"""A draft core's proposals under a grammar, through Chat Completions: the drafts are cut by the
grammar mask before verification, so JSON-schema answers equal the non-speculative ones."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
from live import live_server, metrics

from helios.config import ServerConfig
from tests.engine.test_draft_core import CODE, cores  # noqa: F401 - the module's tiny-core fixture


def test_grammar_constrained_answers_are_the_same_with_a_draft_core(cores: tuple[Path, Path]) -> None:
    """Drafts from the draft core are cut by the grammar mask before verification: JSON-schema
    answers through Chat Completions equal the non-speculative ones, and drafts were verified."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
        "additionalProperties": False,
    }
    # temperature 0 is clamped to the recipe's 0.01, so a seed makes the near-ties of a random tiny model repeatable
    bodies = [
        {
            "model": "m",
            "max_tokens": 40,
            "temperature": 0,
            "seed": 5,
            "messages": [{"role": "user", "content": text}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
        }
        for text in (CODE, "the cat sat on the mat and the cat sat on", "1, 2, 3, 4,")
    ]

    def answers(**settings) -> tuple[list, dict]:
        config = ServerConfig(kv_pages=128, host_cache=False, **settings)
        with live_server(cores[0], config) as (url, _):
            out = []
            for body in bodies:
                response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                out.append((choice["message"]["content"], choice["finish_reason"]))
            return out, metrics(url)

    plain, _ = answers(speculation="off")
    for draft in cores:  # another seed's core and the target itself: their unconstrained drafts are cut by the grammar
        drafted, counters = answers(
            speculation="fixed", max_draft_tokens=4, history_drafts=False, draft_core=str(draft)
        )
        assert drafted == plain
        assert counters["verification_drafts"] > 0 and counters["learned_draft_tokens_total"] > 0
    assert all(msgspec.json.decode(text) is not None for text, reason in plain if reason == "stop")
