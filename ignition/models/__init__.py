"""Architecture families ignition can compile: one module per family, each ending with
`FAMILY = Family.of(...)` or `Family(...)` (ignition.models.family: the contract, field by field); this registry
maps family names to those values.
"""

from __future__ import annotations

from ignition.models import (
    deepseek_v3,
    deepseek_v4,
    gemma3,
    gemma4,
    glm5_next,
    glm_moe_dsa,
    llama,
    mimo_v2,
    minimax_m3,
    muse_spark,
    nemotron_h,
    qwen3,
    qwen3_moe,
    qwen3_next,
    step3p7,
)
from ignition.models.family import Family

FAMILIES: dict[str, Family] = {
    m.FAMILY.name: m.FAMILY
    for m in (
        llama,
        qwen3,
        qwen3_moe,
        gemma3,
        gemma4,
        deepseek_v3,
        deepseek_v4,
        glm_moe_dsa,
        minimax_m3,
        muse_spark,
        step3p7,
        nemotron_h,
        qwen3_next,
        mimo_v2,
        glm5_next,
    )
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"architecture family {name!r} is not supported by this ignition (supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def family_of_hf_config(config: dict) -> str | None:
    """The family that handles a Hugging Face config, or None."""
    archs = set(config.get("architectures") or [])
    for name, fam in FAMILIES.items():
        if archs & set(fam.hf_architectures) or config.get("model_type") in fam.hf_model_types:
            return name
    return None


def family_of_gguf(architecture: str) -> str | None:
    for name, fam in FAMILIES.items():
        if fam.gguf is not None and architecture in fam.gguf.architectures:
            return name
    return None
