"""Grammar compiles are tried in worker processes: a compiler crash, a missed deadline or a
memory-hungry grammar costs a 400, never the server; the cache is bounded in bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend import grammar_probe
from helios.frontend.grammar import GrammarError
from helios.frontend.request import Frontend

CHAIN = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(2800)) + 'r2800: "c"\n'


@pytest.fixture()
def frontend(tiny_core: Path) -> Frontend:
    frontend = Frontend(Core.open(tiny_core), ServerConfig(grammar_cache_mb=64))
    yield frontend
    frontend.grammars.probe.close()


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_the_segfault_grammar_is_refused_by_its_precheck(frontend: Frontend) -> None:
    with pytest.raises(GrammarError, match="2802 rules"):
        frontend.grammars.compile("lark", CHAIN, "response_format")
    with pytest.raises(GrammarError, match="6000 alternatives"):
        frontend.grammars.compile("lark", "start: " + " | ".join(f'"w{i}"' for i in range(6000)), "response_format")
    with pytest.raises(GrammarError, match="nest"):
        frontend.grammars.compile("regex", "(" * 60 + "a" + ")" * 60, "response_format")


def test_a_compiler_crash_kills_only_a_worker(frontend: Frontend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_probe, "MAX_LARK_RULES", 10_000)  # let the crashing grammar reach llguidance
    with pytest.raises(GrammarError, match="could not be compiled"):
        frontend.grammars.compile("lark", CHAIN, "response_format")
    assert frontend.grammars.probe.crashes == 1
    matcher = frontend.grammars.compile("regex", "[0-9]+", "response_format")  # a fresh worker answers
    assert not matcher.is_error()


def test_a_missed_deadline_kills_the_compile(frontend: Frontend) -> None:
    frontend.grammars.compile("regex", "x", "response_format")  # the worker is up
    frontend.grammars.timeout_s = 1e-4
    with pytest.raises(GrammarError, match="longer than"):
        frontend.grammars.compile("json_schema", '{"type": "array", "items": {"type": "string"}}', "response_format")
    frontend.grammars.timeout_s = 5.0
    assert not frontend.grammars.compile("regex", "[a-z]+", "response_format").is_error()


def test_pathological_regexes_stay_within_the_cache_bound(frontend: Frontend) -> None:
    before = _rss()
    for i in range(20):
        with pytest.raises(GrammarError):
            frontend.grammars.compile("regex", f"(k{i}{{1000}}){{1000}}", "response_format")
    for i in range(20):  # allowed, but each holds megabytes: the cache keeps what fits in 64 MiB
        frontend.grammars.compile("regex", f"(k{i}{{100}}){{99}}", "response_format")
    assert frontend.grammars.cached_bytes <= 64 << 20
    assert _rss() - before < 256 << 20


def test_tool_grammars_go_through_the_workers_too(frontend: Frontend) -> None:
    with pytest.raises(GrammarError, match="rules"):
        frontend.grammars.tool_grammar("lark", CHAIN, "tools[0].format")
    assert frontend.grammars.tool_grammar("regex", "[a-z]+", "tools[0].format").matches("abc")
