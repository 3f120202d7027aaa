"""/v1/systemone and /v1/decisions on the SmolLM2 core: every probability equals an
independent /v1/completions read of the same rendered prompt with logprob_token_ids."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from serving import API_KEY, Server, running_server

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend.request import Frontend
from helios.frontend.scoring import CompiledQuestion, compile_questions
from helios.protocols import decisions, systemone
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source

SYSTEMONE_EXAMPLE = {
    "model": "local",
    "state": {"message": "Charged twice"},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "criteria": {"billing": None, "support": "Other help"}},
        "urgency": {"type": "score", "criteria": ["Routine", "Urgent"]},
    },
}
DECISIONS_EXAMPLE = {
    "model": "local",
    "input": "Charged twice",
    "questions": [
        {"type": "predicate", "name": "refund", "instructions": "Refund requested?"},
        {
            "type": "choice",
            "instructions": "Which team?",
            "choices": [{"value": "billing", "description": "Payments"}, {"value": False}],
        },
        {
            "type": "score",
            "instructions": "Urgency?",
            "levels": [{"label": "Routine"}, {"label": "Urgent", "description": "Act today"}],
        },
    ],
}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def frontend(smollm2_core: Path) -> Frontend:
    return Frontend(Core.open(smollm2_core, verify_checksums=False), ServerConfig())


def _reference(server: Server, question: CompiledQuestion) -> tuple[list[float], float]:
    """(normalized label probabilities, raw label mass) from a plain completion of the text."""
    response = server.post(
        "/v1/completions",
        {
            "model": "x",
            "prompt": question.prompt.text,
            "max_tokens": 1,
            "logprobs": 0,
            "ignore_eos": True,
            "logprob_token_ids": list(question.label_ids),
            "return_tokens_as_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(question.prompt.token_ids)  # same text, same tokens
    values = body["choices"][0]["logprobs"]["top_logprobs"][0]
    raw = [math.exp(values[f"token_id:{token}"]) for token in question.label_ids]
    return [x / sum(raw) for x in raw], sum(raw)


def _check_prompts(frontend: Frontend, compiled: list[CompiledQuestion], state_text: str) -> None:
    for question in compiled:
        text = question.prompt.text
        assert text.endswith("Answer:<|im_end|>\n<|im_start|>assistant\n") and state_text in text
        assert [frontend.tokenizer.decode([t]) for t in question.label_ids] == list(question.labels)
    first = compiled[0].prompt.token_ids
    shared = next(i for i, (a, b) in enumerate(zip(first, compiled[1].prompt.token_ids)) if a != b)
    assert shared > 0.5 * len(first)  # the system and state messages form a common prefix


def test_systemone_example_matches_completions(smol: Server, frontend: Frontend) -> None:
    response = smol.post("/v1/systemone", SYSTEMONE_EXAMPLE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == smol.get("/v1/models").json()["data"][0]["id"] and response.headers["x-request-id"]
    request = systemone.decode(SYSTEMONE_EXAMPLE)
    compiled = compile_questions(frontend, request.state, [(q.key, q.spec) for q in request.questions])
    _check_prompts(frontend, compiled, '{"message": "Charged twice"}')
    refund, team, urgency = (_reference(smol, q)[0] for q in compiled)
    answers = body["answers"]
    assert set(answers["refund"]) == {"type", "noul"}  # Jev nouls carry no confidence
    assert answers["refund"]["noul"] == pytest.approx(refund[0], abs=TOLERANCE)
    choice = answers["team"]
    assert list(choice["probabilities"]) == ["billing", "support"]
    assert list(choice["probabilities"].values()) == pytest.approx(team, abs=TOLERANCE)
    assert choice["choice"] == ["billing", "support"][team.index(max(team))]
    assert choice["confidence"] == pytest.approx(abs(2 * max(team) - 1), abs=2 * TOLERANCE)
    score = answers["urgency"]
    assert score["legend"] == {"0": "Routine", "1": "Urgent"}
    assert list(score["probabilities"].values()) == pytest.approx(urgency, abs=TOLERANCE)
    assert score["score"] == pytest.approx(urgency[1], abs=TOLERANCE)
    assert score["confidence"] == pytest.approx(1 - 2 * min(urgency), abs=2 * TOLERANCE)  # k=2: 1 - dist/0.5
    assert body["usage"] == {"input_tokens": sum(len(q.prompt.token_ids) for q in compiled), "output_tokens": 3}


def test_decisions_example_matches_completions(smol: Server, frontend: Frontend) -> None:
    response = smol.post("/v1/decisions", DECISIONS_EXAMPLE)
    assert response.status_code == 200, response.text
    body = response.json()
    request = decisions.decode(DECISIONS_EXAMPLE)
    compiled = compile_questions(frontend, request.text, [(str(i), q.spec) for i, q in enumerate(request.questions)])
    _check_prompts(frontend, compiled, "State:\nCharged twice")
    references = [_reference(smol, q) for q in compiled]
    predicate, choice, score = body["answers"]
    assert predicate == {
        "type": "predicate",
        "name": "refund",
        "probability": pytest.approx(references[0][0][0], abs=TOLERANCE),
    }
    for answer, (p, mass) in zip((choice, score), references[1:]):
        assert answer["name"] is None
        assert [e["probability"] for e in answer["probabilities"]] == pytest.approx(p, abs=TOLERANCE)
        assert answer["confidence"] == pytest.approx(
            max(p) * mass, abs=TOLERANCE
        )  # winner's full-vocabulary probability
    assert [e["value"] for e in choice["probabilities"]] == ["billing", False]
    assert choice["choice"] == ["billing", False][references[1][0].index(max(references[1][0]))]
    assert [(e["value"], e["label"]) for e in score["probabilities"]] == [(0, "Routine"), (1, "Urgent")]
    usage = body["usage"]
    assert usage["input_tokens"] == sum(len(q.prompt.token_ids) for q in compiled) and usage["output_tokens"] == 3
    assert usage["total_tokens"] == usage["input_tokens"] + 3 and usage["output_tokens_details"] == {
        "reasoning_tokens": 0
    }
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # later questions reuse the shared prefix


def test_many_options_get_distinct_single_token_labels(smol: Server) -> None:
    criteria = {f"team-{i}": None for i in range(128)}
    body = smol.post(
        "/v1/systemone", {"model": "m", "state": "x", "questions": {"q": {"type": "choice", "criteria": criteria}}}
    )
    assert body.status_code == 200, body.text
    answer = body.json()["answers"]["q"]
    assert list(answer["probabilities"]) == list(criteria) and sum(answer["probabilities"].values()) == pytest.approx(
        1.0
    )


def test_systemone_schema_failures_are_422_detail_lists(smol: Server) -> None:
    cases = [
        ({"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}, ["body", "model"], "missing"),
        ({"model": "m", "state": "s", "questions": {}}, ["body", "questions"], "too_short"),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "box"}}},
            ["body", "questions", "q"],
            "union_tag_invalid",
        ),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "score", "criteria": ["x"] * 11}}},
            ["body", "questions", "q", "score", "criteria"],
            "too_long",
        ),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "choice"}}},
            ["body", "questions", "q", "choice", "criteria"],
            "missing",
        ),
        (
            {"model": "m", "state": 5, "questions": {"q": {"type": "noul", "instructions": "?"}}},
            ["body", "state", "str"],
            "string_type",
        ),
    ]
    for body, loc, kind in cases:
        response = smol.post("/v1/systemone", body)
        assert response.status_code == 422, body
        entries = response.json()["detail"]
        assert any(e["loc"] == loc and e["type"] == kind and e["msg"] for e in entries), entries
    malformed = httpx.post(smol.url + "/v1/systemone", content=b"{", headers=smol.auth(), timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    assets = {**SYSTEMONE_EXAMPLE, "assets": {"img": {"data_base64": "iVBORw0KGgo=", "format": "png"}}}
    for headers in ({}, {"TypeSafe-Danger-Zone-Images": "true"}):
        refused = smol.post("/v1/systemone", assets, headers=headers)
        assert refused.status_code == 400 and "vision core" in refused.json()["error"]["message"]
    unauthorized = httpx.post(smol.url + "/v1/systemone", json=SYSTEMONE_EXAMPLE, timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"


def test_decisions_failures_are_openai_400s(smol: Server) -> None:
    question = {"type": "predicate", "instructions": "?"}
    cases = [
        ({"model": "m", "input": "x", "questions": [question], "stream": True}, "stream"),
        ({"model": "m", "input": "x", "questions": [{**question, "name": None}]}, "questions.0.name"),
        (
            {
                "model": "m",
                "input": "x",
                "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}],
            },
            "questions.0.choices.1.value",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                "questions": [question],
            },
            "input.0.content.0",
        ),
        ({"model": "m", "input": "x", "questions": [{"type": "refusal", "instructions": "?"}]}, "questions.0.type"),
        ({"model": "m", "input": "x", "questions": [question] * 65}, "questions"),
    ]
    for body, param in cases:
        response = smol.post("/v1/decisions", body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] is None and error["type"] == "invalid_request_error" and param in error["message"]


def test_cores_without_explicit_ids_answer_400(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("cores") / "tiny-no-ids"
    export_core(open_source(str(tiny_checkpoint)), load_recipe("smollm2"), ExportOptions(out=out, logprob_ids=False))
    assert Core.open(out, verify_checksums=False).manifest.capabilities.explicit_logprob_ids is False
    with running_server(out, tmp_path_factory.mktemp("no-ids"), api_key=API_KEY) as server:
        for route, body in (("/v1/systemone", SYSTEMONE_EXAMPLE), ("/v1/decisions", DECISIONS_EXAMPLE)):
            response = server.post(route, body)
            assert response.status_code == 400, response.text
            assert "re-export" in response.json()["error"]["message"]
