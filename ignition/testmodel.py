"""ignition testmodel: tiny random-weight Hugging Face checkpoints for tests.

Each carries its family's special tokens and chat template and a small byte-level BPE
tokenizer, and is a deterministic function of (family, seed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.pre_tokenizers import ByteLevel

from ignition.errors import UsageError
from ignition.models import FAMILIES

# A fixed handful of merges so common English words are multi-byte tokens.
_MERGES = [
    "Ġ t",
    "h e",
    "Ġ a",
    "i n",
    "Ġt he",
    "r e",
    "o n",
    "e r",
    "Ġ s",
    "a t",
    "e n",
    "o r",
    "Ġ c",
    "Ġ w",
    "i s",
    "Ġ o",
    "a n",
    "Ġ b",
    "Ġ f",
    "Ġ p",
    "e s",
    "Ġ i",
    "Ġ m",
    "l l",
    "a r",
    "Ġ h",
    "o u",
    "i t",
]


def build_tokenizer(special_tokens: tuple[str, ...]) -> Tokenizer:
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(special_tokens)}
    for char in sorted(ByteLevel.alphabet(), key=lambda c: ord(c)):
        vocab[char] = len(vocab)
    merges = []
    for merge in _MERGES:
        left, right = merge.split(" ")
        if left in vocab and right in vocab and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer


DATA = Path(__file__).resolve().parent / "models" / "data"

# Chat flavours: another family's special tokens, token roles and published template on a
# test checkpoint, so template, reasoning and tool paths run on a tiny model. A "-vision"
# flavour is its text flavour plus the family's image framing tokens, appended (ids unchanged).
Chat = dict[str, Any]


def _chat(special_tokens: tuple[str, ...], roles: dict[str, str], template: str | None) -> Chat:
    return {"special_tokens": special_tokens, "roles": roles, "template": template}


def _plus(base: Chat, *tokens: str, template: str | None = None) -> Chat:
    """`base` with `tokens` appended (and another template, where given)."""
    return _chat((*base["special_tokens"], *tokens), base["roles"], template or base["template"])


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
_CHATML_TOOLS = (*_CHATML, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_CHATML_ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
_QWEN3 = _chat(_CHATML_TOOLS, _CHATML_ROLES, "qwen3.jinja")
# Gemma 4's turn, channel and tool tokens (the gemma4 family's own test tokens) and media placeholders.
_GEMMA4 = _chat(
    (*FAMILIES["gemma4"].tiny.special_tokens, "<|image|>", "<|audio|>", "<|video|>"),
    {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "gemma4.jinja",
)
_KIMI3 = _chat(
    ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|kimi_image_placeholder|>"),
    {"eos_token": "<|end_of_msg|>", "pad_token": "<|end_of_msg|>"},
    "kimi3.jinja",
)
_MINIMAX_M3 = _chat(
    ("[e~[", "]~!b[", "]~b]", "]<]minimax[>[", "<mm:think>", "</mm:think>", "]<]image[>[", "]<]video[>["),
    {"eos_token": "[e~[", "pad_token": "[e~["},
    "minimax_m3.jinja",
)
_STEP = _chat(
    (
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<|im_start|>",
        "<|im_end|>",
        *_CHATML_TOOLS[3:],
        "<im_patch>",
    ),
    {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<|im_end|>", "pad_token": "<｜end▁of▁sentence｜>"},
    "step3.5-flash.jinja",
)
_GLM53 = _chat(
    (
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ),
    {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "glm53.jinja",
)
CHATS: dict[str, Chat] = {
    "qwen3": _QWEN3,
    # The qwen3 flavour with Muse Spark's image framing (<|image_start|> <|patch|>... <|image_end|>) and
    # placeholders: vision test models; the template (muse_spark.jinja, not published) is qwen3.jinja
    # rendering each image part as <|patch|>.
    "muse_spark-vision": _plus(
        _QWEN3, "<|image_start|>", "<|image_end|>", "<|audio|>", "<|video|>", "<|patch|>", template="muse_spark.jinja"
    ),
    # Qwen3.5 / 3.8: ChatML with function-tag tool calls (the qwen3_coder syntax) and <think> reasoning.
    "qwen3.5": _plus(_QWEN3, "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", template="qwen3.5.jinja"),
    # Gemma 4's turn, channel and tool tokens with its published template (tools, thinking, responses).
    "gemma4": _GEMMA4,
    # The same with Gemma 4's image framing tokens (<|image> <|image|>... <image|>): vision test models.
    "gemma4-vision": _plus(_GEMMA4, "<|image>", "<image|>"),
    # Kimi K3's tag tokens (<|open|>TAG<|sep|>...<|close|>TAG<|sep|>) and its published template
    # (../shared/templates/kimi-k3.jinja, llama.cpp's Kimi-K3.jinja); a message ends with <|end_of_msg|>.
    "kimi3": _KIMI3,
    # The same with Kimi K2.5's image framing (<|media_begin|>image<|media_content|><|media_pad|>...<|media_end|>,
    # "image" one token as in Kimi's vocabulary): vision test models; the template renders
    # <|kimi_image_placeholder|> per image.
    "kimi_k3-vision": _plus(
        _KIMI3,
        "<|media_begin|>",
        "<|media_content|>",
        "<|media_end|>",
        "<|media_pad|>",
        "image",
        "<|kimi_k25_video_placeholder|>",
    ),
    # MiniMax M3's tokens and published template (../shared/templates/minimax-m3.jinja, llama.cpp's
    # MiniMax-M3.jinja): ]~!b[ begins, ]~b]ROLE opens a turn, [e~[ ends it; tool tags sit behind ]<]minimax[>[.
    "minimax_m3": _MINIMAX_M3,
    # The same with MiniMax M3's image framing tokens (]<]start of image[>[ ]<]image[>[... ]<]end of image[>[):
    # vision test models.
    "minimax_m3-vision": _plus(_MINIMAX_M3, "]<]start of image[>[", "]<]end of image[>["),
    # StepFun's ChatML turns, <think> reasoning and function-tag <tool_call>s, with Step-3.5-Flash's
    # published template (../shared/templates/step-3.5-flash.jinja); it opens with {{bos_token}}
    # and renders image parts as <im_patch>.
    "step": _STEP,
    # The same with Step 3.7's image framing tokens (<im_start> <patch_start> ... <patch_newline>): vision test models.
    "step5-vision": _plus(_STEP, "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"),
    # GLM-5.3-Flash's role and tool tokens and its published template (../shared/templates/glm-5.3-flash.jinja);
    # the model ends a turn with <|endoftext|> here (real checkpoints also stop at <|user|> / <|observation|>).
    "glm53": _GLM53,
    # The same with GLM's image and video framing tokens (the template renders
    # <|begin_of_image|><|image|><|end_of_image|> per image): vision test models.
    "glm53-vision": _plus(
        _GLM53,
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|video|>",
    ),
    # NVIDIA Nemotron 3 Nano's ChatML turns, <think> reasoning and Qwen3-Coder-style function-tag tool
    # calls, with its published template (../shared/templates/nemotron-3-nano.jinja, CRLF as published);
    # the generation prompt opens <think>\n.
    "nemotron": _chat(
        ("<unk>", "<s>", "</s>", *_CHATML_TOOLS[1:]),
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<unk>", "unk_token": "<unk>"},
        "nemotron-3-nano.jinja",
    ),
    # MiMo-V2's ChatML turns, <think> reasoning and compact function-tag calls (the mimo tool syntax),
    # with a small template written for the tests: no MiMo template is published in ../shared/templates/.
    "mimo": _chat(_CHATML_TOOLS, _CHATML_ROLES, "mimo_v2.jinja"),
    # DeepSeek V4 / V4.1 spellings (deepseek_recipe.SpecialToken defaults), each one token. No
    # template: these cores lower chats through the native encoder (native:deepseek_v4*).
    "deepseek": _chat(
        (
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜System｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜latest_reminder｜>",
            "<think>",
            "</think>",
            "｜DSML｜",
        ),
        {
            "bos_token": "<｜begin▁of▁sentence｜>",
            "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>",
        },
        None,
    ),
}


def write_testmodel(
    family_name: str,
    out: Path,
    seed: int = 0,
    chat: str | None = None,
    vision: bool = False,
    overrides: dict | None = None,
) -> Path:
    """vision: a multimodal checkpoint (the family's tiny.vision config, its processor config and
    its vision chat flavour, e.g. gemma4-vision); overrides: config.json fields replacing the
    family's test config before the tensors are made to fit it (e.g. num_nextn_predict_layers)."""
    if family_name not in FAMILIES:
        raise UsageError(f"no test model for family {family_name!r} (supported: {', '.join(sorted(FAMILIES))})")
    fam = FAMILIES[family_name]
    tiny = fam.tiny
    if vision and tiny.vision is None:
        raise UsageError(f"no vision test model for family {family_name!r}")
    if vision and chat is None and tiny.vision is not None:  # the family's own vision flavour (glm5_next: glm53-vision)
        chat = tiny.vision.chat
    chat = chat or tiny.chat  # a family may default to a chat flavour (Qwen3's own tokens)
    if chat is not None and chat not in CHATS:
        raise UsageError(f"no chat flavour {chat!r} (supported: {', '.join(sorted(CHATS))})")
    specials = CHATS[chat]["special_tokens"] if chat else tiny.special_tokens
    roles = CHATS[chat]["roles"] if chat else dict(tiny.token_roles)
    if chat:  # a flavour without a template file serves through a native encoder
        template_file = CHATS[chat]["template"]
        template = (DATA / template_file).read_text(encoding="utf-8") if template_file else None
    else:
        template = tiny.chat_template
    tokenizer = build_tokenizer(specials)
    config = tiny.config(tokenizer.get_vocab_size()) | (overrides or {})
    config.update(
        {
            name.replace("_token", "_token_id"): tokenizer.token_to_id(tok)
            for name, tok in roles.items()
            if name != "unk_token"
        }
    )
    if vision and tiny.vision is not None:
        framing = {t: tokenizer.token_to_id(t) for t in tiny.vision.tokens}
        if None in framing.values():
            raise UsageError(f"chat flavour {chat!r} has no image framing tokens")
        # The text config's token ids stay at the top level unless the vision config sets its own (muse_spark's
        # image / video placeholders move to the flavour's tokens).
        config = {k: v for k, v in config.items() if k.endswith("_token_id")} | tiny.vision.config(config, framing)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: _tensor(tiny.init, name, shape, generator)
        for name, shape in tiny.hf_shapes(fam.config_from_hf(config)).items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    tok_config = dict(roles, add_bos_token=False, model_max_length=config["max_position_embeddings"])
    if template is not None:
        tok_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    if vision and tiny.vision is not None:
        (out / "preprocessor_config.json").write_text(
            json.dumps(dict(tiny.vision.processor), indent=2, sort_keys=True) + "\n"
        )
    return out


def _tensor(
    special: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor | None] | None,
    name: str,
    shape: tuple[int, ...],
    generator: torch.Generator,
) -> torch.Tensor:
    tensor = special(name, shape, generator) if special is not None else None
    return _init(name, shape, generator) if tensor is None else tensor


def _init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norms: near one, so the network is not trivially symmetric
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) * (1.0 / shape[1] ** 0.5)
