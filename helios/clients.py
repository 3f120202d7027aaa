"""Ready configurations of coding clients for a loaded core (`helios clients codex|claude|opencode`).

Each configuration is one shell block: pasted into a shell it writes the client's own files
(never its main settings file) and says how to start the client. The values come from the
core manifest and the serving configuration, so the client's limits match what helios serves.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from helios.config import ServerConfig
from helios.core.manifest import Manifest

MAX_CLIENT_OUTPUT = 32000  # what Claude Code and OpenCode ask for by default
NO_KEY = "none"  # a nonempty placeholder for clients that insist on a key when auth is off
CODEX_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # Codex's reasoning vocabulary
# Codex's own instructions are about 4k tokens; a small model's context needs a short prompt.
CODEX_INSTRUCTIONS = (
    "You are a coding agent running in the Codex CLI on the user's computer. Work in the current "
    "directory: inspect files with the shell tool, edit them with apply_patch, run the project's tests "
    "when you change code, and answer concisely."
)


@dataclass(frozen=True, slots=True)
class Target:
    """What a client needs to know about the serving helios and its core."""

    url: str  # helios' origin without /v1, e.g. http://127.0.0.1:8000
    model: str  # the id /v1/models advertises (first configured alias, else the core's public id)
    context: int  # tokens of prompt plus output per request (the core's max_model_len)
    output: int  # the output limit clients ask for: 1 <= output < context
    api_key: str | None  # None: authentication disabled
    vision: bool
    efforts: tuple[str, ...]  # named reasoning efforts; empty without reasoning syntax
    default_effort: str | None
    tools: bool  # the core's recipe declares a tool-call syntax


def output_limit(context: int, default_max_tokens: int | None) -> int:
    """An eighth of the context (at most 32,000), leaving clients room for their prompts; never
    above the server's default_max_tokens. helios bounds any limit by the remaining context."""
    limit = min(MAX_CLIENT_OUTPUT, max(1, context // 8))
    return limit if default_max_tokens is None else min(limit, default_max_tokens)


def target(manifest: Manifest, config: ServerConfig, url: str | None = None) -> Target:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    origin = (url or f"http://{host}:{config.port}").rstrip("/")
    origin = origin[: -len("/v1")] if origin.endswith("/v1") else origin
    model = next((a for a in (*config.aliases, *manifest.model.aliases) if a), manifest.model.id)
    recipe = manifest.recipe
    efforts = tuple(e for e in recipe.effort_levels if e in CODEX_EFFORTS) if recipe.reasoning_syntax else ()
    context = manifest.limits.max_model_len
    return Target(
        origin,
        model,
        context,
        output_limit(context, config.default_max_tokens),
        config.api_key,
        manifest.capabilities.vision,
        efforts,
        recipe.default_effort if recipe.default_effort in efforts else None,
        recipe.tool_syntax is not None,
    )


def _file(path: str, text: str) -> str:
    """A shell command writing text verbatim (quoted here-document) to path (expanded)."""
    return f"cat > \"{path}\" <<'FLARE_EOF'\n{text.rstrip()}\nFLARE_EOF"


def _toml(value: str) -> str:
    return json.dumps(value)  # a TOML basic string: JSON's escapes are valid TOML escapes


def codex_catalog(t: Target) -> dict[str, object]:
    """Codex's model catalog (`model_catalog_json`): the core's context and capabilities, and
    the freeform apply_patch tool (a custom tool whose Lark grammar helios validates)."""
    return {
        "models": [
            {
                "slug": t.model,
                "display_name": t.model,
                "description": f"Served by Flare helios ({t.context}-token context)",
                "default_reasoning_level": t.default_effort,
                "supported_reasoning_levels": [
                    {"effort": e, "description": f"{e} reasoning effort"} for e in t.efforts
                ],
                "shell_type": "shell_command",
                "visibility": "list",
                "supported_in_api": True,
                "priority": 0,
                "availability_nux": None,
                "upgrade": None,
                "base_instructions": CODEX_INSTRUCTIONS,
                "supports_reasoning_summaries": False,
                "support_verbosity": False,
                "default_verbosity": None,
                "apply_patch_tool_type": "freeform",
                "truncation_policy": {"mode": "tokens", "limit": max(256, min(10000, t.context // 8))},
                "supports_parallel_tool_calls": t.tools,
                "context_window": t.context,
                "experimental_supported_tools": [],
                "input_modalities": ["text", "image"] if t.vision else ["text"],
            }
        ]
    }


def codex(t: Target) -> str:
    profile = "\n".join(
        [
            f"# Flare helios serving {t.model}. Start Codex with: codex --profile flare",
            'model_provider = "flare"',
            f"model = {_toml(t.model)}",
            'model_catalog_json = "flare-models.json"  # beside this file, in CODEX_HOME',
            'web_search = "disabled"  # helios has no hosted tools',
            "check_for_update_on_startup = false",
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[model_providers.flare]",
            'name = "Flare"',
            f"base_url = {_toml(t.url + '/v1')}",
            'wire_api = "responses"',
            *([f"experimental_bearer_token = {_toml(t.api_key)}"] if t.api_key else []),
        ]
    )
    return "\n".join(
        [
            "# Codex 0.162.1: a `flare` profile and its model catalog in CODEX_HOME (default ~/.codex).",
            'dir="${CODEX_HOME:-$HOME/.codex}" && mkdir -p "$dir"',
            _file("$dir/flare.config.toml", profile),
            _file("$dir/flare-models.json", json.dumps(codex_catalog(t), indent=2)),
            "echo 'Codex: codex --profile flare'",
        ]
    )


def claude_settings(t: Target) -> dict[str, object]:
    """Claude Code settings (environment only): helios' URL, key and model for every role, the
    core's context and an output limit that leaves room for Claude Code's prompt."""
    env = {
        "ANTHROPIC_BASE_URL": t.url,
        "ANTHROPIC_API_KEY": t.api_key or NO_KEY,  # --bare reads no other credential
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(t.context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.output),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    return {"env": env}


def claude(t: Target) -> str:
    return "\n".join(
        [
            "# Claude Code 2.1.296: settings in CLAUDE_CONFIG_DIR (default ~/.claude), used with --settings.",
            "# --bare (minimal mode: 3 tools, a short system prompt) leaves a small context room to work;",
            "# the normal mode's prompt alone is about 4k tokens before its tool definitions.",
            'dir="${CLAUDE_CONFIG_DIR:-$HOME/.claude}" && mkdir -p "$dir"',
            _file("$dir/flare.json", json.dumps(claude_settings(t), indent=2)),
            'echo "Claude Code: claude --bare --settings $dir/flare.json  (or without --bare)"',
        ]
    )


def opencode_config(t: Target) -> dict[str, object]:
    """An OpenCode provider through @ai-sdk/openai-compatible (bundled with OpenCode) that
    declares the core's context and the output limit, so OpenCode never asks for more."""
    options: dict[str, object] = {"baseURL": t.url + "/v1"}
    if t.api_key:
        options["apiKey"] = t.api_key
    model = {
        "name": t.model,
        "limit": {"context": t.context, "output": t.output},
        "tool_call": t.tools,
        "reasoning": bool(t.efforts),
    }
    if t.vision:
        model["attachment"] = True
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "flare": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Flare",
                "options": options,
                "models": {t.model: model},
            }
        },
        "model": f"flare/{t.model}",
        "small_model": f"flare/{t.model}",
        "autoupdate": False,
        "share": "disabled",
    }


def opencode(t: Target) -> str:
    return "\n".join(
        [
            "# OpenCode 1.18.33: a `flare` provider in its own file, chosen with OPENCODE_CONFIG.",
            'dir="${XDG_CONFIG_HOME:-$HOME/.config}/opencode" && mkdir -p "$dir"',
            _file("$dir/flare.json", json.dumps(opencode_config(t), indent=2)),
            'echo "OpenCode: OPENCODE_CONFIG=$dir/flare.json opencode"',
        ]
    )


CLIENTS: dict[str, Callable[[Target], str]] = {"codex": codex, "claude": claude, "opencode": opencode}
