"""Architecture families ignition can compile; one module per family.

Each family module provides: FAMILY, HF_ARCHITECTURES, HF_MODEL_TYPES, GGUF_ARCHITECTURES,
WEIGHT_MAP, FUSED, config_from_hf, kv_shape, decode_weight_bytes, StepProgram,
reference_logits, and for test checkpoints testmodel_config, hf_shapes and TEST_CHAT (a
chat flavour of ignition.testmodel.CHATS, or None for its own TEST_SPECIAL_TOKENS,
TEST_TOKEN_ROLES and TEST_CHAT_TEMPLATE). Families that read GGUF (non-empty
GGUF_ARCHITECTURES) also provide GGUF_WEIGHT_MAP, hf_config_from_gguf, gguf_tensor_fixup.
Optional: STACKED (MoE expert stacks, ignition.models.moe), SHARED_KV (True: one cache
tensor per layer read as keys and values, KvLayout.shared_kv; MLA's latent cache),
extra_caches(config) (per-token caches beside the KV in some layers, KvLayout.extra: tuples
(name, layers, num_heads, head_dim); MiniMax M3's and GLM's indexer keys), state_caches(config)
(recurrent state slots, KvLayout.state: tuples (name, layers, per-slot shape, dtype); Nemotron-H's
conv windows and SSM states) and ignored_tensor(config, name)
-> bool (checkpoint tensors export leaves out: vision towers, MTP layers), canonical_tensors(config,
tensors) -> tensors (a second checkpoint layout rewritten into the names WEIGHT_MAP reads, before
anything else sees them; Step 3.7's hub vision layout), and
testmodel_init(name, shape, generator) (a test tensor the generic init cannot make, or None),
duplicates(config) (internal name -> the name it may be an exact copy of; export keeps such a copy
once), extra_step_outputs(config) (TensorSpecs the step programs return after program_signature's; MiMo's
hidden states) and extra_programs(config, num_top, weights) (program kinds beyond step/scored_prefill that
export traces into the core: objects with kind, module, inputs, outputs, examples and check, as
ignition.models.mtp.ExtraProgram; the mtp_draft.N drafter programs of MiMo and DeepSeek-V3 (kimi_k3)).
"""

from __future__ import annotations

from types import ModuleType

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

FAMILIES: dict[str, ModuleType] = {
    m.FAMILY: m
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


def family(name: str) -> ModuleType:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"architecture family {name!r} is not supported by this ignition (supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def family_of_hf_config(config: dict) -> str | None:
    """The family that handles a Hugging Face config, or None."""
    archs = set(config.get("architectures") or [])
    for name, module in FAMILIES.items():
        if archs & set(module.HF_ARCHITECTURES) or config.get("model_type") in module.HF_MODEL_TYPES:
            return name
    return None


def family_of_gguf(architecture: str) -> str | None:
    for name, module in FAMILIES.items():
        if architecture in module.GGUF_ARCHITECTURES:
            return name
    return None
