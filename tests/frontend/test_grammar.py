"""The bounded grammar service: compile limits, errors naming the field, exact matching."""

from __future__ import annotations

import threading

import pytest

from helios.frontend import grammar
from helios.frontend.grammar import GrammarError, compile_grammar

APPLY_PATCH = r"""
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Update File: " filename LF change+
filename: /(.+)/
change: ("+" | "-" | " ") /(.*)/ LF
%import common.LF
"""


def test_lark_grammar_matches_complete_sentences_only() -> None:
    g = compile_grammar("lark", APPLY_PATCH, "tools[0].format")
    good = "*** Begin Patch\n*** Update File: a.py\n-old\n+new\n*** End Patch"
    assert g.matches(good)
    assert g.matches(good + "\n")
    assert not g.matches(good[:-3])  # a prefix is not a sentence
    assert not g.matches(good + "\nextra")
    assert not g.matches("")


def test_lark_common_imports_and_ignore() -> None:
    g = compile_grammar(
        "lark", '%import common.NUMBER\n%import common.WS\n%ignore WS\nstart: NUMBER ("+" NUMBER)*', "f"
    )
    assert g.matches("1 + 2.5+3")
    assert not g.matches("1 +")


def test_regex_matches_the_whole_text_by_bytes() -> None:
    g = compile_grammar("regex", r"\d{3}-\d{4}", "f")
    assert g.matches("555-1234")
    assert not g.matches("555-12345")
    assert not g.matches("x555-1234")
    unicode = compile_grammar("regex", "é+[0-9]", "f")
    assert unicode.matches("éé7")
    assert not unicode.matches("e7")
    assert compile_grammar("regex", "x*", "f").matches("")


def test_matching_is_repeatable_after_a_failure() -> None:
    g = compile_grammar("regex", "ab", "f")
    assert not g.matches("zz")
    assert g.matches("ab")  # a failed match does not poison the compiled grammar


@pytest.mark.parametrize(
    ("syntax", "definition", "needle"),
    [
        ("lark", "start: undefined_rule", "unknown name"),
        ("lark", 'rule: "a"', "start"),
        ("regex", "[a-z", "unclosed"),
        ("lark", "   ", "nonempty"),
        ("yacc", "start: 'a'", "syntax"),
    ],
)
def test_invalid_grammars_name_the_field(syntax: str, definition: str, needle: str) -> None:
    with pytest.raises(GrammarError) as info:
        compile_grammar(syntax, definition, "tools[2].format.definition")
    assert info.value.field == "tools[2].format.definition"
    assert "tools[2].format.definition" in info.value.message and needle in info.value.message
    assert isinstance(info.value, ValueError)


def test_oversized_grammar_is_rejected_before_compiling() -> None:
    definition = "start: " + " | ".join(f'"{i:070d}"' for i in range(1000))
    with pytest.raises(GrammarError, match="over the 65536-byte limit") as info:
        compile_grammar("lark", definition, "tools[1].format")
    assert info.value.field == "tools[1].format"
    assert compile_grammar("lark", definition, "f", max_bytes=1 << 20).matches(f"{999:070d}")


def test_slow_compile_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = grammar._byte_tokenizer

    def stalled():  # stands in for a pathological grammar: compilation does not finish in time
        release.wait(10)
        return real()

    monkeypatch.setattr(grammar, "_byte_tokenizer", stalled)
    try:
        with pytest.raises(GrammarError, match="longer than 0.05 s") as info:
            compile_grammar("regex", "a+", "format", timeout_s=0.05)
        assert info.value.field == "format"
    finally:
        release.set()
