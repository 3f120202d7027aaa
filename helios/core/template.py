"""Chat template rendering with Hugging Face `apply_chat_template` semantics (Jinja sandbox, HF globals).

A `ChatTemplate` is built once per model from its published template and special tokens; errors
that a request can cause surface as `TemplateError`, which the server reports as HTTP 400.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

# Names the renderer itself binds; chat_template_kwargs may not replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
# Older names of `reasoning_content`; transformers copies whichever is set into all of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message so its end can be found after rendering (transformers 5 does the same).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Exceptions a template can raise while evaluating expressions on request data.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class TemplateError(ValueError):
    """The chat template cannot render this request (or cannot be compiled); the message says why."""


class _Raised(jinja2.TemplateError):
    """`raise_exception(msg)` called by the template itself."""


def _raise_exception(message: str) -> NoReturn:
    raise _Raised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes and ignores these options; templates expect json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    # Replaces the `dict` class global so templates cannot reach type internals through it.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace would reach CPython internals; transformers rejects them too.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attribute {name!r} on a namespace")


def _compile(source: str, mutable: bool) -> jinja2.Template:
    env_class = SandboxedEnvironment if mutable else ImmutableSandboxedEnvironment
    env = env_class(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def _plain(value: Any) -> Any:
    """A fresh copy built from JSON-like types, so templates (mutable ones included) never touch caller data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(_plain(v) for v in value)
    for base in (str, bool, int, float):  # subclasses such as str enums lose their extra methods
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Reject chat_template_kwargs that would replace a name the renderer binds (call before `**`-splatting)."""
    clash = sorted(RESERVED_NAMES.intersection(kwargs))
    if clash:
        raise TemplateError(f"chat_template_kwargs may not set reserved names: {', '.join(clash)}")


class ChatTemplate:
    """One model's chat template, compiled once; `render` is safe to call concurrently."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, str | None] | None = None, *, mutable: bool = False
    ) -> None:
        self.source = source
        # bos_token, eos_token, ...: visible to the template as variables, overridable by template kwargs.
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.mutable = mutable  # True once the template has needed list.append/.pop (Kimi K2)
        self._template = _compile(source, mutable)
        self._inline_system: bool | None = None

    def render(
        self,
        messages: list[dict[str, Any]],
        /,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(..., tokenize=False) renders it.

        continue_final_message: end the prompt right after the final (assistant) message's content so
        the model continues that message, instead of closing it.
        """
        check_template_kwargs(template_kwargs)
        if add_generation_prompt and continue_final_message:
            raise TemplateError("add_generation_prompt and continue_final_message cannot both be set")
        if not all(isinstance(m, Mapping) for m in messages):
            raise TemplateError("every chat message must be an object")
        chat = [_alias_reasoning(m) for m in _plain(list(messages))]
        final = self._tag_final_message(chat) if continue_final_message else ""
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        variables.update(
            messages=chat, tools=_plain(tools), documents=_plain(documents), add_generation_prompt=add_generation_prompt
        )
        text = self._render(variables)
        return self._cut_after_final(text, final) if continue_final_message else text

    def supports_inline_system(self) -> bool:
        """Whether a system message after the first turn renders in place (probed once, then cached)."""
        if self._inline_system is None:
            probe = f"PROBE-SYS-{secrets.token_hex(8)}"
            conversation = [
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"},
                {"role": "system", "content": probe},
                {"role": "user", "content": "U2"},
            ]
            try:
                self._inline_system = probe in self.render(conversation)
            except TemplateError:
                self._inline_system = False
        return self._inline_system

    def _render(self, variables: dict[str, Any]) -> str:
        try:
            return self._template.render(**variables)
        except SecurityError as e:
            if self.mutable:
                raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
            # Some templates append to lists they build; they need the (still sandboxed) mutable env.
            self._template, self.mutable = _compile(self.source, True), True
            return self._render(variables)
        except _Raised as e:
            raise TemplateError(f"chat template rejected the conversation: {e.message}") from e
        except _RENDER_ERRORS as e:
            raise TemplateError(f"chat template failed to render ({type(e).__name__}): {e}") from e

    def _tag_final_message(self, chat: list[dict[str, Any]]) -> str:
        """Append the continuation tag to the final message's text; returns that text (untagged)."""
        if not chat or chat[-1].get("role") != "assistant":
            raise TemplateError("continue_final_message requires the final message to be an assistant message")
        last = chat[-1]
        content = last.get("content")
        if isinstance(content, list):
            block = next((b for b in reversed(content) if isinstance(b, dict) and "text" in b), None)
            if block is None:
                raise TemplateError("continue_final_message: the final message has no text to continue")
            final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return str(final)
        if not isinstance(content, str):
            raise TemplateError("continue_final_message: the final message has no content to continue")
        last["content"] = content + _CONTINUE_TAG
        return content

    @staticmethod
    def _cut_after_final(text: str, final: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TemplateError(
                "continue_final_message: the chat template does not render the final message's "
                "content verbatim, so it cannot be continued"
            )
        at = text.rindex(tag)
        if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the message, so trailing space is not the model's
