"""Label normalization and confidence formulas (spec/decisions-notes.md §2, §4.5), and the
System One / Decisions codecs, without a model."""

from __future__ import annotations

import math

import pytest

from helios.frontend.inference import RequestError
from helios.frontend.scoring import (
    LabelRead,
    choice_confidence,
    expected_score,
    first_argmax,
    label_mass_confidence,
    normalize,
    score_confidence,
)
from helios.protocols import decisions, systemone

# Published or recorded (p, confidence) points; the notes recomputed each with the formula.
CHOICE_POINTS = [
    ([0.84, 0.16, 0.0], 0.760),
    ([0.61, 0.35, 0.04], 0.415),
    ([0.40, 0.34, 0.24, 0.02], 0.200),
    ([0.88, 0.12, 0.0], 0.820),
    ([0.0, 0.18, 0.82], 0.730),
    ([0.0, 0.0, 0.02, 0.98], 0.973),
    ([0.08, 0.16, 0.10, 0.24, 0.42], 0.275),
]
SCORE_POINTS = [
    ([0.0, 0.57, 0.43], 0.355),
    ([0.0, 0.95, 0.05], 0.925),
    ([0.45, 0.55, 0.0], 0.325),
    ([0.03, 0.97], 0.940),
    ([0.0, 0.25, 0.75], 0.625),
    ([0.0, 0.05, 0.47, 0.48], 0.430),
    ([0.0, 0.01, 0.09, 0.50, 0.37, 0.03], 0.640),
]


@pytest.mark.parametrize(("p", "expected"), CHOICE_POINTS)
def test_choice_confidence_matches_published_points(p: list[float], expected: float) -> None:
    assert choice_confidence(p) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(("p", "expected"), SCORE_POINTS)
def test_score_confidence_matches_published_points(p: list[float], expected: float) -> None:
    assert score_confidence(p) == pytest.approx(expected, abs=1e-3)


def test_documented_test_vectors() -> None:
    assert choice_confidence([1.0]) == 1.0
    assert choice_confidence([0.5, 0.5]) == 0.0
    assert choice_confidence([1 / 3, 1 / 3, 1 / 3]) == 0.0  # float noise is clamped
    assert (score_confidence([1.0]), expected_score([1.0])) == (1.0, 0.0)
    assert (score_confidence([0.5, 0.0, 0.5]), expected_score([0.5, 0.0, 0.5])) == (0.0, 1.0)
    assert score_confidence([0.1] * 10) == pytest.approx(0.0, abs=1e-12) and expected_score(
        [0.1] * 10
    ) == pytest.approx(4.5)
    assert expected_score([0.0, 0.95, 0.05]) == pytest.approx(1.05)


def test_ties_go_to_the_first_option() -> None:
    assert first_argmax([0.2, 0.4, 0.4]) == 1
    assert score_confidence([0.2, 0.4, 0.4]) == pytest.approx(0.1)  # mode 1, not 2 (which would give 0)
    assert score_confidence([0.4, 0.4, 0.2]) == pytest.approx(0.0)


def test_normalization_and_label_mass() -> None:
    logprobs = (math.log(0.3), math.log(0.1), math.log(0.2))
    p, mass = normalize(logprobs)
    assert p == pytest.approx((0.5, 1 / 6, 1 / 3)) and mass == pytest.approx(0.6)
    read = LabelRead(logprobs, p, mass)
    assert label_mass_confidence(read) == pytest.approx(0.3)  # the winner's full-vocabulary probability
    assert normalize((-1e4, -1e4 - math.log(3)))[0] == pytest.approx((0.75, 0.25))  # tiny masses stay exact
    assert normalize((-math.inf, -math.inf)) == ((0.5, 0.5), 0.0)


def test_systemone_answers_carry_only_jev_fields() -> None:
    request = systemone.decode(
        {
            "model": "m",
            "state": ["structured", {"x": 1}],
            "questions": {
                "n": {"type": "noul", "criteria": {"true": {"if": "yes"}}},
                "c": {"type": "choice", "criteria": {"b": None, "a": ["x"]}},
                "s": {"type": "score", "criteria": ["low", {"level": "high"}]},
            },
        }
    )
    assert request.state == '["structured", {"x": 1}]'
    noul, choice, score = request.questions
    assert noul.spec.options[0].description == '{"if": "yes"}'
    reads = [
        LabelRead((0.0, 0.0), (0.75, 0.25), 1.0),
        LabelRead((0.0, 0.0), (0.5, 0.5), 1.0),
        LabelRead((0.0, 0.0), (0.2, 0.8), 1.0),
    ]
    answers = [systemone.answer(q, r) for q, r in zip(request.questions, reads)]
    assert answers[0] == {"type": "noul", "noul": 0.75}
    assert answers[1] == {"type": "choice", "choice": "b", "probabilities": {"b": 0.5, "a": 0.5}, "confidence": 0.0}
    assert answers[2]["legend"] == {"0": "low", "1": {"level": "high"}} and answers[2]["score"] == pytest.approx(0.8)


def test_decisions_decoding() -> None:
    request = decisions.decode(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"role": "user", "content": "c", "type": "message"},
            ],
            "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "true"}, {"value": True}]}],
        }
    )
    assert request.text == "a\nb\n\nc"
    assert request.questions[0].values == ("true", True) and request.questions[0].name is None
    bad = [
        ({"input": "x", "questions": []}, "questions"),
        ({"input": "x", "questions": [{"type": "predicate"}]}, "questions.0.instructions"),
        (
            {"input": [{"role": "system", "content": "x"}], "questions": [{"type": "predicate", "instructions": "?"}]},
            "input.0.role",
        ),
        (
            {"input": "x", "questions": [{"type": "score", "instructions": "?", "levels": [{"label": "a"}]}]},
            "questions.0.levels",
        ),
        ({"input": "x", "questions": [{"type": "predicate", "instructions": "?", "extra": 1}]}, "questions.0.extra"),
    ]
    for body, param in bad:
        with pytest.raises(RequestError) as failure:
            decisions.decode({"model": "m", **body})
        assert failure.value.param == param
