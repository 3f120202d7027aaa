"""The Llama family (Llama 2/3 dense, SmolLM2): config, weight maps, step program, reference.

The step program is written functionally over a weights dict so torch.export saves the
graph without weights; attention goes through the flare:: paged-KV ops.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor

from ignition.models import common
from ignition.models.family import Family, Gguf, Reference, TinyCheckpoint

NAME = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)
HF_MODEL_TYPES = ("llama",)
GGUF_ARCHITECTURES = ("llama",)

# Hugging Face checkpoint name -> internal name (stored in the core's safetensors).
WEIGHT_MAP = {**common.ATTENTION_WEIGHT_MAP, **common.SWIGLU_WEIGHT_MAP}
FUSED = common.DENSE_FUSED

# GGUF tensor name -> Hugging Face name (llama.cpp's convert_hf_to_gguf naming).
GGUF_WEIGHT_MAP = {
    **common.GGUF_DECODER_MAP,
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}


LlamaConfig = common.DenseConfig


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Read a Hugging Face config.json dict; unsupported variants raise ValueError."""
    return common.DenseConfig(intermediate_size=int(hf["intermediate_size"]), **common.decoder_fields(hf, NAME, 2048))


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Translate llama.cpp GGUF metadata into a Hugging Face style config dict."""
    arch = meta["general.architecture"]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def gguf_tensor_fixup(hf_name: str, tensor: Tensor, hf: dict[str, Any]) -> Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves for ggml's rope)."""
    if hf_name.endswith("q_proj.weight"):
        return _unpermute(tensor, int(hf["num_attention_heads"]))
    if hf_name.endswith("k_proj.weight"):
        return _unpermute(tensor, int(hf["num_key_value_heads"]))
    return tensor


def _unpermute(weight: Tensor, num_heads: int) -> Tensor:
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class StepProgram(common.DecoderProgram):
    """Llama's step: the shared decoder with a fused SwiGLU MLP and no q/k transform."""


def reference_logits(config: LlamaConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """The shared plain-torch reference forward with Llama's dense SwiGLU MLP."""
    return common.reference_logits(
        config, hf_weights, token_ids, lambda w, p, h: common.reference_swiglu(w, p + "mlp.", h)
    )


# ----------------------------------------------------------------------- test checkpoints


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints."""
    return common.tiny_decoder_config("LlamaForCausalLM", "llama", vocab_size) | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


# SmolLM2's control tokens (ids 0..16) and chat template, carried by test checkpoints
# (TEST_CHAT None: no other family's chat flavour by default).
TEST_CHAT: str | None = None
TEST_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
)
TEST_TOKEN_ROLES = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
TEST_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a checkpoint with this config."""
    return common.decoder_shapes(
        c, {**common.attention_shapes(c), **common.swiglu_shapes("mlp.", c.hidden_size, c.intermediate_size)}
    )


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family.of(
    sys.modules[__name__],
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(
        testmodel_config, hf_shapes, TEST_CHAT, TEST_SPECIAL_TOKENS, TEST_TOKEN_ROLES, TEST_CHAT_TEMPLATE
    ),
    gguf=Gguf(GGUF_ARCHITECTURES, GGUF_WEIGHT_MAP, hf_config_from_gguf, gguf_tensor_fixup),
)
