"""The Llama family (Llama 2/3 dense, SmolLM2): config, weight maps, step program, reference.

The step program is written functionally over a weights dict so torch.export saves the
graph without weights; attention goes through the flare:: paged-KV ops.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ignition.models import common
from ignition.models.common import (
    ATTENTION_WEIGHT_MAP,
    DecoderProgram,
    DenseConfig,
    attention_shapes,
    decode_weight_bytes,
    decoder_fields,
    decoder_shapes,
    kv_shape,
    reference_swiglu,
)
from ignition.models.family import Family, Gguf, Reference, TinyCheckpoint

NAME = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM",)
HF_MODEL_TYPES = ("llama",)
GGUF_ARCHITECTURES = ("llama",)

# Hugging Face checkpoint name -> internal name (stored in the core's safetensors).
WEIGHT_MAP = {
    **ATTENTION_WEIGHT_MAP,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
}

# Internal tensors concatenated (along output rows) into one, so a layer runs fewer matmuls.
FUSED = {
    "layers.{}.wqkv": ("layers.{}.wq", "layers.{}.wk", "layers.{}.wv"),
    "layers.{}.w_gate_up": ("layers.{}.w_gate", "layers.{}.w_up"),
}

# GGUF tensor name -> Hugging Face name (llama.cpp's convert_hf_to_gguf naming).
GGUF_WEIGHT_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


LlamaConfig = DenseConfig


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Read a Hugging Face config.json dict; unsupported variants raise ValueError."""
    return DenseConfig(intermediate_size=int(hf["intermediate_size"]), **decoder_fields(hf, NAME, 2048))


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


class StepProgram(DecoderProgram):
    """Llama's step: the shared decoder with a fused SwiGLU MLP and no q/k transform."""


def reference_logits(config: LlamaConfig, hf_weights: dict[str, Tensor], token_ids: list[int]) -> Tensor:
    """The shared plain-torch reference forward with Llama's dense SwiGLU MLP."""
    return common.reference_logits(config, hf_weights, token_ids, lambda w, p, h: reference_swiglu(w, p + "mlp.", h))


# ----------------------------------------------------------------------- test checkpoints


def testmodel_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Hugging Face config for random-weight test checkpoints."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
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
    h, f = c.hidden_size, c.intermediate_size
    mlp = {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return decoder_shapes(c, {**attention_shapes(c), **mlp})


# ---------------------------------------------------------------------- the family contract (ignition.models.family)


FAMILY = Family(
    name=NAME,
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    weight_map=WEIGHT_MAP,
    fused=FUSED,
    kv_shape=kv_shape,
    decode_weight_bytes=decode_weight_bytes,
    step_program=StepProgram,
    reference=Reference(reference_logits),
    tiny=TinyCheckpoint(
        config=testmodel_config,
        hf_shapes=hf_shapes,
        chat=TEST_CHAT,
        special_tokens=TEST_SPECIAL_TOKENS,
        token_roles=TEST_TOKEN_ROLES,
        chat_template=TEST_CHAT_TEMPLATE,
    ),
    gguf=Gguf(
        architectures=GGUF_ARCHITECTURES,
        weight_map=GGUF_WEIGHT_MAP,
        hf_config=hf_config_from_gguf,
        tensor_fixup=gguf_tensor_fixup,
    ),
)
