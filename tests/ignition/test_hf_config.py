"""The field tables families read config.json with (ignition.models.hf_config)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ignition.models.hf_config import REQUIRED, AttentionHeads, Fields, Key


@dataclass(frozen=True, slots=True)
class _Config:
    size: int
    eps: float
    tied: bool
    layers: int
    kernel: int
    shape: tuple[int, ...]


_TABLE = Fields(
    _Config,
    size=REQUIRED,
    eps=1e-6,
    tied=False,
    layers=Key(("depth", "num_hidden_layers"), 4),
    kernel=Key("conv_kernel", 3, or_default=True),
)


def test_fields_convert_to_the_declared_types_with_the_defaults() -> None:
    assert _TABLE.read({"size": "8"}) == {"size": 8, "eps": 1e-6, "tied": False, "layers": 4, "kernel": 3}
    read = _TABLE.read({"size": 8, "eps": 1, "tied": 1, "num_hidden_layers": 6, "conv_kernel": 5})
    assert read == {"size": 8, "eps": 1.0, "tied": True, "layers": 6, "kernel": 5}
    assert type(read["eps"]) is float and type(read["tied"]) is bool


@pytest.mark.parametrize(
    ("hf", "layers"),
    [
        ({"depth": 2, "num_hidden_layers": 6}, 2),  # the first spelling present wins
        ({"num_hidden_layers": 6}, 6),
        ({}, 4),
    ],
)
def test_the_first_spelling_present_wins(hf: dict, layers: int) -> None:
    assert _TABLE.read({"size": 1, **hf})["layers"] == layers


def test_or_default_treats_null_and_zero_as_absent_and_plain_keys_do_not() -> None:
    assert _TABLE.read({"size": 1, "conv_kernel": None})["kernel"] == 3
    assert _TABLE.read({"size": 1, "conv_kernel": 0})["kernel"] == 3
    with pytest.raises(TypeError):  # a null where a number is due, as int(hf.get(key, default)) raises
        _TABLE.read({"size": 1, "eps": None})
    with pytest.raises(KeyError, match="size"):
        _TABLE.read({})


def test_a_table_is_checked_against_its_dataclass() -> None:
    with pytest.raises(TypeError, match="no field 'width'"):
        Fields(_Config, width=3)
    with pytest.raises(TypeError, match="shape"):
        Fields(_Config, shape=(1,))


def test_attention_heads_default_to_one_kv_head_per_query_head_and_hidden_over_heads() -> None:
    assert AttentionHeads.from_hf({"num_attention_heads": 4, "hidden_size": 64}) == (4, 4, 16)
    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 64}
    assert AttentionHeads.from_hf(hf)._asdict() == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
