"""Reading a Hugging Face config.json dict into a family's frozen config dataclass.

Most fields of a family's config are plain numbers and flags, each read from one config.json key
with the default of the reference implementation. A family lists those in a table bound to its
dataclass, and passes what `read` returns (converted to the fields' declared types) together with
the fields it computes itself, each field exactly once:

    _FIELDS = Fields(
        Config,
        vocab_size=129280,                                 # hf.get("vocab_size", 129280)
        intermediate_size=REQUIRED,                        # hf["intermediate_size"]
        num_layers=Key("num_hidden_layers", 43),           # hf.get("num_hidden_layers", 43)
        head_dim=Key("head_dim", 128, or_default=True),    # hf.get("head_dim") or 128
        num_heads=Key(("num_heads", "num_attention_heads"), 16),  # the first spelling present, else 16
    )
    return Config(**_FIELDS.read(hf), layer_types=...)

Whatever a family reads another way (validated, derived, nested elsewhere, or read before the config
is built) stays spelled out in its own config_from_hf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ignition.models import moe


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final[Any] = _Required()  # a Key's default: the key must be present (KeyError otherwise)

# The field types a table reads; anything else (tuples, nested specs, optionals) a family builds itself.
_CONVERTERS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


@dataclass(frozen=True, slots=True)
class Key:
    """Where one field's value is in config.json: the key `name`, or the first present of several
    spellings; `default` when none is present. With `or_default`, a null, zero, false or empty
    value counts as absent too (transformers' `config.get(name) or default`)."""

    name: str | tuple[str, ...]
    default: Any = REQUIRED
    or_default: bool = False

    def value(self, hf: Mapping[str, Any]) -> Any:
        names = (self.name,) if isinstance(self.name, str) else self.name
        for name in names:
            if name in hf and (hf[name] or not self.or_default):
                return hf[name]
        if self.default is REQUIRED:
            raise KeyError(names[0])
        return self.default


class Fields:
    """One family's table of the fields of `cls` read straight from config.json: field name ->
    Key, or a plain default (then the key is the field's own name). Checked against `cls` when built."""

    __slots__ = ("_keys", "_types")

    def __init__(self, cls: type, **table: Any) -> None:
        declared = {f.name: f.type for f in dataclasses.fields(cls)}
        types: dict[str, type] = {}
        for field in table:
            if field not in declared:
                raise TypeError(f"{cls.__name__} has no field {field!r}")
            kind = declared[field]
            converter = _CONVERTERS.get(kind if isinstance(kind, str) else getattr(kind, "__name__", ""))
            if converter is None:
                raise TypeError(
                    f"{cls.__name__}.{field} is a {kind}; a field table reads only int, float, bool and str"
                )
            types[field] = converter
        self._keys = {f: k if isinstance(k, Key) else Key(f, k) for f, k in table.items()}
        self._types = types

    def read(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The table's fields, each converted to its declared type (a null where a number is due
        raises TypeError, a missing REQUIRED key KeyError)."""
        return {field: self._types[field](key.value(hf)) for field, key in self._keys.items()}


class AttentionHeads(NamedTuple):
    """A GQA decoder's head counts as transformers reads them: num_attention_heads, num_key_value_heads
    (absent or null: as many as the query heads) and head_dim (absent or null: hidden_size / heads).
    Its fields are the configs' own names (`**heads._asdict()` fills them)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> AttentionHeads:
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        return cls(heads, kv_heads, int(hf.get("head_dim") or int(hf["hidden_size"]) // heads))


def grouped_sigmoid_router(
    hf: Mapping[str, Any], num_experts: int, top_k: int, routed_scaling_factor: float
) -> moe.RouterSpec:
    """DeepSeek-V3-style routing as transformers reads it (DeepSeek-V3, GLM-5, MiMo-V2): sigmoid
    scores plus a per-expert correction bias, top-k within the topk_group best of n_group groups
    (a null or 0 counts as 1), renormalized unless norm_topk_prob is false."""
    return moe.RouterSpec(
        num_experts=num_experts,
        top_k=top_k,
        scoring="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=routed_scaling_factor,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        has_correction_bias=True,
        norm_eps=1e-20,
    )
