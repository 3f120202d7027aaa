"""Chat template rendering: parity with transformers' apply_chat_template and the published templates."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from helios.core.template import ChatTemplate, TemplateError, check_template_kwargs
from ignition.models.llama import TEST_CHAT_TEMPLATE, TEST_TOKEN_ROLES

TEMPLATES = Path(__file__).resolve().parents[3] / "shared" / "templates"
TEMPLATE_FILES = sorted(TEMPLATES.glob("*.jinja"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SYSTEM_USER = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Wie heißt du? ☃"}]
MULTI_TURN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "Two plus two is four."},
    {"role": "user", "content": "And 3+3?"},
]
KIMI_TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21C"},
]


def reference(source: str, messages: list[dict], special: dict, **kwargs: object) -> str:
    """What transformers renders (apply_chat_template passes special tokens as template variables)."""
    return render_jinja_template([messages], chat_template=source, **special, **kwargs)[0][0]


def load(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hey!"},
            {"role": "user", "content": "ça va?"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_matches_transformers(messages: list[dict], add_generation_prompt: bool) -> None:
    ours = ChatTemplate(TEST_CHAT_TEMPLATE, TEST_TOKEN_ROLES).render(
        messages, add_generation_prompt=add_generation_prompt
    )
    assert ours == reference(
        TEST_CHAT_TEMPLATE, messages, TEST_TOKEN_ROLES, add_generation_prompt=add_generation_prompt
    )
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_published_templates_match_transformers(path: Path, tools: list[dict] | None) -> None:
    source = path.read_text()
    template = ChatTemplate(source, SPECIAL)
    for messages in (SYSTEM_USER, MULTI_TURN):
        ours = template.render(messages, tools=tools)
        assert ours == reference(source, messages, SPECIAL, tools=tools, add_generation_prompt=True)
        assert "Answer briefly." in ours and messages[-1]["content"] in ours
    if tools is not None and path.stem != "deepseek-v3.1":  # V3.1 expects tools described in the system prompt
        assert "get_weather" in ours


@pytest.mark.parametrize("name", ["kimi-k2.jinja", "kimi-k2-thinking.jinja"])
def test_kimi_tool_turn_falls_back_to_mutable_sandbox(name: str) -> None:
    source = load(name)
    with pytest.raises(Exception, match="unsafe"):  # transformers' immutable sandbox cannot render it
        reference(source, KIMI_TOOL_TURN, {}, add_generation_prompt=True)
    template = ChatTemplate(source, SPECIAL)
    assert not template.mutable
    text = template.render(KIMI_TOOL_TURN)
    assert template.mutable
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}' in text
    assert "## Return of functions.get_weather:0\nSunny, 21C" in text
    assert ChatTemplate(source, SPECIAL, mutable=True).render(KIMI_TOOL_TURN) == text


def test_mutable_template_cannot_touch_caller_messages() -> None:
    template = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}", mutable=True)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "2"
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("content", ["The answer is", "The answer is ", "  The answer is\n"])
@pytest.mark.parametrize("name", ["smollm2", "qwen3.jinja", "glm-4.7.jinja"])
def test_continue_final_message_matches_transformers(name: str, content: str) -> None:
    source = TEST_CHAT_TEMPLATE if name == "smollm2" else load(name)
    messages = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": content}]
    ours = ChatTemplate(source, SPECIAL).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == reference(source, messages, SPECIAL, continue_final_message=True)
    assert ours.rstrip().endswith("The answer is")
    if name == "smollm2":
        assert ours.endswith("<|im_start|>assistant\n" + content)


def test_continue_final_message_errors() -> None:
    template = ChatTemplate(TEST_CHAT_TEMPLATE)
    assistant_last = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    with pytest.raises(TemplateError, match="assistant"):
        template.render([{"role": "user", "content": "Q"}], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(TemplateError, match="cannot both"):
        template.render(assistant_last, add_generation_prompt=True, continue_final_message=True)
    dropping = ChatTemplate(
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="verbatim"):
        dropping.render(assistant_last, add_generation_prompt=False, continue_final_message=True)


INITIAL_SYSTEM_ONLY = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
DROPS_SYSTEM = (
    "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "source, expected",
    [(load("qwen3.jinja"), True), (TEST_CHAT_TEMPLATE, True), (INITIAL_SYSTEM_ONLY, False), (DROPS_SYSTEM, False)],
    ids=["qwen3", "smollm2", "raises", "omits"],
)
def test_inline_system_probe(source: str, expected: bool) -> None:
    template = ChatTemplate(source, SPECIAL)
    assert template.supports_inline_system() is expected
    assert template.supports_inline_system() is expected


def test_raise_exception_becomes_template_error() -> None:
    template = ChatTemplate(INITIAL_SYSTEM_ONLY)
    with pytest.raises(TemplateError, match="System message must be first"):
        template.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_jinja_errors_become_template_errors() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")
    with pytest.raises(TemplateError, match="UndefinedError"):
        ChatTemplate("{{ missing.attribute }}").render([])
    with pytest.raises(TemplateError, match="TypeError"):  # content None concatenated to a string
        ChatTemplate(TEST_CHAT_TEMPLATE).render([{"role": "user", "content": None}])
    with pytest.raises(TemplateError, match="sandbox"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_tojson_follows_transformers() -> None:
    source = "{{ tools | tojson }}|{{ tools | tojson(indent=2, sort_keys=True) }}|{{ tools | tojson(separators=(',', ':')) }}"
    tools = [{"name": "météo", "b": "<&>", "a": 1}]
    ours = ChatTemplate(source).render([], tools=tools)
    plain, indented, compact = ours.split("|")
    assert plain == '[{"name": "météo", "b": "<&>", "a": 1}]'  # no \u escapes, no HTML escaping
    assert indented == json.dumps(tools, ensure_ascii=False, indent=2, sort_keys=True)
    assert compact == '[{"name":"météo","b":"<&>","a":1}]'
    assert ours == reference(source, [], {}, tools=tools)


def test_template_kwargs_and_globals() -> None:
    qwen3 = ChatTemplate(load("qwen3.jinja"))
    user = [{"role": "user", "content": "Hi"}]
    assert qwen3.render(user, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.render(user).endswith("<|im_start|>assistant\n")
    assert (
        ChatTemplate("{{ bos_token }}{{ strftime_now('%Y') }}", SPECIAL).render([])
        == f"<s>{datetime.date.today().year}"
    )
    assert ChatTemplate("{{ bos_token }}", SPECIAL).render([], bos_token="<B>") == "<B>"


def test_reserved_template_kwargs_are_rejected() -> None:
    template = ChatTemplate(TEST_CHAT_TEMPLATE)
    with pytest.raises(TemplateError, match="messages"):
        template.render([{"role": "user", "content": "a"}], messages=[])
    with pytest.raises(TemplateError, match="add_generation_prompt, tools"):
        check_template_kwargs({"tools": [], "add_generation_prompt": False, "enable_thinking": True})
    check_template_kwargs({"enable_thinking": True})
