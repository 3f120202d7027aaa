"""export --quantize from a quantized GGUF: Q8_0 / Q4_0 / Q4_1 / Q4_K blocks are kept on their
own grid (the stored values equal gguf's own dequantization exactly, through llama.cpp's q/k row
permutation and the q/k/v and gate/up fusions), other block types are requantized with their
error reported. A tiny GGUF with SmolLM2's tokenizer stands in; the shipped SmolLM2 Q4_1 GGUF
itself is exported only with FLARE_SLOW_TESTS=1."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helios.core import Core, quant
from helios.core.golden import recheck
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import family
from ignition.quant_check import check_stored
from ignition.quantize import QuantRequest
from ignition.recipe import load_recipe
from ignition.sources import open_source

# Block type of each tensor of the one-layer test GGUF (hidden 256, MLP 512: Q4_K/Q6_K rows need 256).
TYPES = {
    "token_embd.weight": "Q8_0",
    "blk.0.attn_q.weight": "Q4_1",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_K",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q6_K",
}
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
# The float16 fields of a K-quant block: (byte offset, value): Q4_K's d and dmin, Q6_K's d (last).
K_SCALES = {"Q4_K": ((0, 0.004), (2, 0.002)), "Q6_K": ((208, 0.0002),)}


def write_tiny_gguf(smollm2: Path, out: Path) -> Path:
    """A random one-layer llama GGUF with SmolLM2's tokenizer metadata and TYPES' blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    reader = GGUFReader(str(smollm2))
    writer = GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "llama.")):
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_context_length(512)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (vocab, HIDDEN),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        qtype = GGMLQuantizationType[TYPES[name]]
        if TYPES[name] in K_SCALES:  # gguf's Python quantizes no K-quant: random blocks with small scales
            block, size = GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
            for start, value in K_SCALES[TYPES[name]]:
                data[..., start : start + 2] = np.array([value], dtype=np.float16).view(np.uint8)
            writer.add_tensor(name, data.reshape(shape[0], -1), raw_dtype=qtype)
        else:
            values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(smollm2_gguf, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _stored_values(core: Path, name: str, record) -> torch.Tensor:  # noqa: ANN001
    stored = load_file(str(core / "weights.safetensors"))
    return quant.dequantize(
        stored[name + quant.QWEIGHT], stored[name + quant.SCALES], stored.get(name + quant.MINS), record.group
    )


def test_gguf_blocks_keep_their_grid(tiny_gguf: Path, tmp_path: Path) -> None:
    checkpoint = open_source(str(tiny_gguf))
    request = QuantRequest("int4", group=64, embeddings=True, head=True)
    export_core(checkpoint, load_recipe("smollm2"), ExportOptions(out=tmp_path / "core", quantization=request))
    core = Core.open(tmp_path / "core")
    q = core.manifest.quantization
    assert q is not None and "+" in q.level
    origins = {name: (t.origin, t.format, t.group, t.scale_dtype) for name, t in q.tensors.items()}
    assert origins == {
        "embed": ("gguf Q8_0", "int8", 32, "float32"),  # tied: both flags given
        "layers.0.wqkv": ("gguf Q4_0+Q4_1+Q4_K", "int4", 32, "float32"),
        "layers.0.wo": ("gguf Q8_0", "int8", 32, "float32"),
        "layers.0.w_gate_up": ("gguf Q4_1+Q4_K", "int4", 32, "float32"),
        "layers.0.w_down": ("export", "int4", 64, "float32"),  # Q6_K: requantized as asked
    }
    assert q.self_check is not None and set(q.self_check.requantized) == {"layers.0.w_down"}
    scales = load_file(str(tmp_path / "core" / "weights.safetensors"))["layers.0.w_down" + quant.SCALES]
    assert 0 < q.self_check.requantized["layers.0.w_down"] <= 0.51 * float(scales.max())  # half a step at most
    fam = family("llama")
    config = fam.config_from_hf(checkpoint.hf_config)
    exact = internal_weights(fam, checkpoint, config, torch.float32)  # gguf's own dequantization, converted
    for name, record in q.tensors.items():
        if record.origin != "export":
            assert torch.equal(_stored_values(tmp_path / "core", name, record), exact[name]), name
    check_stored(core)
    assert recheck(core) <= core.manifest.golden.tolerance


def test_int8_export_requantizes_4_bit_blocks(tiny_gguf: Path, tmp_path: Path) -> None:
    """Never fewer bits than asked: at int8, Q8_0 blocks are kept and 4-bit blocks requantized."""
    request = QuantRequest("int8", group=32, embeddings=True, head=True)
    export_core(
        open_source(str(tiny_gguf)), load_recipe("smollm2"), ExportOptions(out=tmp_path / "core", quantization=request)
    )
    q = Core.open(tmp_path / "core").manifest.quantization
    assert q is not None and q.level == "int8-g32"
    assert {name: t.origin for name, t in q.tensors.items()} == {
        "embed": "gguf Q8_0",
        "layers.0.wqkv": "export",
        "layers.0.wo": "gguf Q8_0",
        "layers.0.w_gate_up": "export",
        "layers.0.w_down": "export",
    }
    assert q.self_check is not None and set(q.self_check.requantized) == {
        "layers.0.wqkv",
        "layers.0.w_gate_up",
        "layers.0.w_down",
    }


@pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")
@pytest.mark.parametrize("grids", [True, False], ids=["q4_1-kept", "dequantized"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_smollm2_gguf(smollm2_gguf: Path, tmp_path: Path, fmt: str, grids: bool) -> None:
    """The shipped Q4_1 GGUF keeps its grid at int4 (its linears are all Q4_1; at int8 they are
    requantized); from its dequantized values (grids dropped) it is quantized as asked, close to
    the float core."""
    recipe = load_recipe("smollm2")
    checkpoint = open_source(str(smollm2_gguf), recipe.source.checkpoint_id)  # type: ignore[union-attr]
    if not grids:
        checkpoint = replace(checkpoint, grids=None)
    export_core(checkpoint, recipe, ExportOptions(out=tmp_path / "core", quantization=QuantRequest(fmt)))
    core = Core.open(tmp_path / "core")
    q = core.manifest.quantization
    assert q is not None and len(q.tensors) == 30 * 4 and "embed" not in q.tensors  # tied: not asked for
    check = q.self_check
    assert check is not None and check.perplexity_tokens > 2000
    assert (len(check.requantized) == 120) if (grids and fmt == "int8") else (check.requantized == {})
    if grids and fmt == "int4":
        assert q.level == "int4-g32" and {t.origin for t in q.tensors.values()} == {"gguf Q4_1"}
        fam = family("llama")
        exact = internal_weights(fam, checkpoint, fam.config_from_hf(checkpoint.hf_config), torch.float32)
        for name in ("layers.0.wqkv", "layers.29.w_down"):
            assert torch.equal(_stored_values(tmp_path / "core", name, q.tensors[name]), exact[name])
        assert check.top1_agreement == 1.0 and check.perplexity == check.reference_perplexity
    else:  # quantized as asked (at int8 from the Q4_1 values themselves)
        assert q.level == f"{fmt}-g32" and {t.origin for t in q.tensors.values()} == {"export"}
        assert check.top1_agreement > 0.8 and check.perplexity < 1.2 * check.reference_perplexity
    assert recheck(core) <= core.manifest.golden.tolerance
