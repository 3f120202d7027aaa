"""Native DeepSeek V4 / V4.1 prompts: the official encoders' renderings, effort, and rejections."""

from __future__ import annotations

from pathlib import Path

import deepseek_recipe as ds
import pytest

from helios.config import ServerConfig
from helios.core import Core
from helios.frontend.inference import (
    Conversation,
    Message,
    OutputConstraint,
    ReasoningPart,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from helios.frontend.native_deepseek import NativeEncoder
from helios.frontend.request import Frontend
from helios.frontend.scoring import binary_question, compile_question
from helios.protocols import openai_chat

WEATHER = ToolSpec("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}})
HISTORY = (
    Message("system", (TextPart("Be brief."),)),
    Message("user", (TextPart("Weather in Paris? Spelled: <｜User｜> </think>"),)),
    Message(
        "assistant",
        (
            ReasoningPart("Need the tool."),
            TextPart("Checking."),
            ToolCallPart("c1", "get_weather", '{"city": "Paris"}'),
        ),
    ),
    Message("tool", (ToolResultPart("c1", (TextPart("sunny"),)),)),
    Message("assistant", (ReasoningPart("Done."), TextPart("It is sunny."))),
    Message("user", (TextPart("Thanks! ünïcode 日本"),)),
)
OFFICIAL_HISTORY = [
    ds.SystemMessage("Be brief."),
    ds.UserMessage("Weather in Paris? Spelled: <｜User｜> </think>"),
    ds.AssistantMessage("Checking.", "Need the tool.", [ds.ToolCall("c1", "get_weather", '{"city": "Paris"}')]),
    ds.ToolMessage("sunny", "c1"),
    ds.AssistantMessage("It is sunny.", "Done."),
    ds.UserMessage("Thanks! ünïcode 日本"),
]
OFFICIAL_TOOLS = [ds.ToolDefinition(WEATHER.name, WEATHER.description, dict(WEATHER.parameters))]
ASK = (Message("user", (TextPart("Explain why this terminates."),)),)


@pytest.fixture(scope="module")
def v41(deepseek_core: Path) -> Frontend:
    return Frontend(Core.open(deepseek_core), ServerConfig())


@pytest.fixture(scope="module")
def v4(v41: Frontend) -> Frontend:
    """The same core, served through the V4 encoder."""
    frontend = Frontend.__new__(Frontend)
    frontend.__dict__.update(v41.__dict__)
    frontend.native = NativeEncoder("native:deepseek_v4", v41.tokenizer, v41.manifest.recipe.effort_levels, "high")
    return frontend


def official(frontend: Frontend, deepseek_core: Path, messages, **options) -> tuple[tuple[int, ...], str]:
    v41 = frontend.native.numeric  # type: ignore[union-attr]
    encoding = ds.DeepseekV41Encoding() if v41 else ds.DeepseekV4Encoding()
    conversation = ds.Conversation(messages, **options)
    tokenizer = ds.Tokenizer.from_file(str(deepseek_core / "tokenizer.json"))
    return tuple(encoding.with_tokenizer(tokenizer).encode(conversation)), encoding.render_conversation(
        conversation
    ).prompt


@pytest.mark.parametrize("version", ["v4", "v41"])
@pytest.mark.parametrize("case", ["history", "no_thinking", "required", "named", "max", "json"])
def test_prompts_equal_the_official_encoding(version: str, case: str, request, deepseek_core: Path) -> None:
    frontend = request.getfixturevalue(version)
    conversation = Conversation(HISTORY, tools=(WEATHER,))
    options: dict = {"tools": OFFICIAL_TOOLS, "reasoning_effort": "high"}
    output = None
    if case == "no_thinking":
        conversation = Conversation(HISTORY, tools=(WEATHER,), thinking=False)
        options["thinking_mode"] = False
    elif case == "required":
        conversation = Conversation(HISTORY, tools=(WEATHER,), tool_choice=ToolChoice("required"))
        options["tool_choice"] = "required"
    elif case == "named":  # named selection presents only that tool, with no instruction
        named = ToolChoice("named", "get_weather")
        conversation = Conversation(HISTORY, tools=(WEATHER, ToolSpec("other", None, {})), tool_choice=named)
    elif case == "max":
        conversation = Conversation(HISTORY, tools=(WEATHER,), effort="max")
        options["reasoning_effort"] = "max"
    elif case == "json":
        output = OutputConstraint("json_schema", '{"type": "object"}', "response_format")
        options["response_schema"] = {"type": "object"}
    prepared = frontend.prompt(conversation, output)
    ids, text = official(frontend, deepseek_core, OFFICIAL_HISTORY, **options)
    assert prepared.text == text
    assert prepared.token_ids == ids
    assert frontend.tokenizer.decode(list(ids), skip_special_tokens=False) == text


@pytest.mark.parametrize("version", ["v4", "v41"])
def test_effort_defaults_and_neutral_levels(version: str, request, deepseek_core: Path) -> None:
    frontend = request.getfixturevalue(version)
    ask = [ds.UserMessage("Explain why this terminates.")]
    high = official(frontend, deepseek_core, ask, reasoning_effort="high")
    assert frontend.prompt(Conversation(ASK)).token_ids == high[0]  # default: thinking on, high effort
    explicit_null = Conversation(ASK, template_kwargs={"reasoning_effort": None})
    assert frontend.prompt(explicit_null).token_ids == official(frontend, deepseek_core, ask)[0]
    for neutral, level in (("minimal", "low"), ("low", "low"), ("medium", "high"), ("xhigh", "xhigh"), ("max", "max")):
        expected = official(frontend, deepseek_core, ask, reasoning_effort=level)[1]
        assert frontend.prompt(Conversation(ASK, effort=neutral)).text == expected
    named = Conversation(ASK, template_kwargs={"reasoning_effort": "max"})
    assert frontend.prompt(named).text == official(frontend, deepseek_core, ask, reasoning_effort="max")[1]
    with pytest.raises(RequestError) as error:
        frontend.prompt(Conversation(ASK, template_kwargs={"reasoning_effort": "medium"}))
    assert error.value.param == "reasoning_effort"


def _chat(frontend: Frontend, **body) -> Conversation:
    messages = [{"role": "user", "content": "Explain why this terminates."}]
    request, _ = openai_chat.decode({"model": "m", "messages": messages, **body})
    assert isinstance(request.input, Conversation)
    return request.input


def test_v41_numeric_effort_at_top_level_and_in_kwargs(v41: Frontend, deepseek_core: Path) -> None:
    ask = [ds.UserMessage("Explain why this terminates.")]
    ids75, text75 = official(v41, deepseek_core, ask, reasoning_effort="high")
    line = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)"
    for score in (1, 80, 100):
        for conversation in (
            _chat(v41, reasoning_effort=score),
            _chat(v41, chat_template_kwargs={"reasoning_effort": score}),
            _chat(v41, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": score}),
        ):
            prepared = v41.prompt(conversation)
            assert prepared.text == text75.replace(line.format(75), line.format(score), 1)
            assert v41.tokenizer.decode(list(prepared.token_ids), skip_special_tokens=False) == prepared.text
            ours = prepared.token_ids
            start = next(i for i, (a, b) in enumerate(zip(ours, ids75)) if a != b)
            end = next(i for i in range(1, len(ids75)) if ours[-i] != ids75[-i]) - 1  # equal trailing tokens
            assert v41.tokenizer.decode(list(ours[start : len(ours) - end])) in str(score)  # only the score differs
            assert v41.tokenizer.decode(list(ids75[start : len(ids75) - end])) in "75"
    off = v41.prompt(_chat(v41, reasoning_effort=80, chat_template_kwargs={"enable_thinking": False}))
    assert "Reasoning Effort" not in (off.text or "")  # no thinking, no effort prefix


@pytest.mark.parametrize("value", [0, 101, -5, "7", "80", "medium", True, 80.0])
def test_v41_rejects_values_outside_its_vocabulary(v41: Frontend, value) -> None:
    for body in ({"reasoning_effort": value}, {"chat_template_kwargs": {"reasoning_effort": value}}):
        with pytest.raises(RequestError) as error:
            v41.prompt(_chat(v41, **body))
        assert error.value.param == "reasoning_effort"


def test_v4_rejects_numeric_effort(v4: Frontend) -> None:
    for body in ({"reasoning_effort": 80}, {"chat_template_kwargs": {"reasoning_effort": 1}}):
        with pytest.raises(RequestError, match="no numeric") as error:
            v4.prompt(_chat(v4, **body))
        assert error.value.param == "reasoning_effort"


@pytest.mark.parametrize("version", ["v4", "v41"])
def test_unsupported_controls_are_rejected(version: str, request) -> None:
    frontend = request.getfixturevalue(version)
    cases = {
        "add_generation_prompt": {"add_generation_prompt": False},
        "continue_final_message": {
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}],
            "continue_final_message": True,
        },
        "drop_thinking": {"chat_template_kwargs": {"drop_thinking": True}},
    }
    for param, body in cases.items():
        with pytest.raises(RequestError) as error:
            frontend.prompt(_chat(frontend, **body))
        assert error.value.param == param


def test_scoring_renders_through_the_native_encoder(v41: Frontend) -> None:
    question = compile_question(v41, "Charged twice", binary_question("Is a refund requested?"), "questions.refund")
    text = question.prompt.text or ""
    assert text.endswith("Answer:<｜Assistant｜></think>") and "Reasoning Effort" not in text
    ids = v41.tokenizer.encode(text + question.labels[0], add_special_tokens=False).ids
    assert ids[:-1] == list(question.prompt.token_ids) and ids[-1] == question.label_ids[0]


def test_a_tokenizer_without_deepseek_tokens_is_refused_at_load(qwen3_core: Path) -> None:
    with pytest.raises(Exception, match="lacks them"):
        NativeEncoder("native:deepseek_v41", Core.open(qwen3_core).tokenizer(), ("high",), "high")
