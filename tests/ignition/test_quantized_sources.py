"""Quantized and sharded Hugging Face checkpoints: FP8 block-scaled, NVFP4 (ModelOpt and
compressed-tensors) dequantized at export exactly as transformers' own loaders expand them,
sharded directories read through their index, and the manifest recording the source format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from helios.core import Core
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.sources.quantized import E2M1_VALUES, dequantize_fp8_blocks, dequantize_nvfp4, unpack_e2m1

FP8 = torch.float8_e4m3fn


def _fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block quantization: one scale_inv per block x block tile (edge tiles partial)."""
    rows, cols = weight.shape
    grid_rows, grid_cols = -(-rows // block), -(-cols // block)
    scale = torch.empty(grid_rows, grid_cols)
    quantized = torch.empty(rows, cols, dtype=FP8)
    for i in range(grid_rows):
        for j in range(grid_cols):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / torch.finfo(FP8).max
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(FP8)
    return quantized, scale


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_blocks_match_transformers(shape: tuple[int, int]) -> None:
    weight, scale = _fp8_blocks(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), 128)
    ours = dequantize_fp8_blocks(weight, scale, (128, 128))
    theirs = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32))


def test_fp8_ue8m0_scales_and_expert_stacks() -> None:
    weight = torch.randn(3, 128, 256).to(FP8)
    exponents = torch.randint(120, 134, (3, 1, 2), dtype=torch.uint8)
    expected = weight.float() * torch.exp2(exponents.float() - 127).repeat_interleave(128, -1)
    assert torch.equal(dequantize_fp8_blocks(weight, exponents), expected)


def test_e2m1_unpacks_low_nibble_first_like_transformers() -> None:
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    ours = unpack_e2m1(packed)
    assert torch.equal(ours, Fp8Dequantize(None)._unpack_fp4(packed))
    assert ours[0, 2].item() == E2M1_VALUES[1] and ours[0, 3].item() == 0.0  # byte 0x01: low nibble first


def test_nvfp4_value_is_code_times_group_scale_times_tensor_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    scales = (torch.rand(8, 4, generator=gen) * 4 + 0.1).to(FP8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    expected = torch.tensor(E2M1_VALUES)[codes] * scales.float().repeat_interleave(16, -1) * 0.25
    assert torch.equal(dequantize_nvfp4(packed, scales, torch.tensor(0.25)), expected)


# ---------------------------------------------------------------------------- checkpoints on disk


def _quantized_copy(source: Path, out: Path, scheme: str) -> dict[str, torch.Tensor]:
    """`source` (a float checkpoint) with its 2-D projection weights stored in `scheme`;
    returns the float weights the quantized checkpoint stands for."""
    shutil.copytree(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    stored, meant = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() != 2 or "embed" in name or "lm_head" in name:
            stored[name] = meant[name] = tensor
            continue
        base = name.removesuffix(".weight")
        if scheme == "fp8":
            q, scale = _fp8_blocks(tensor.float(), 32)
            stored.update({name: q, f"{base}.weight_scale_inv": scale})
            meant[name] = dequantize_fp8_blocks(q, scale)
        else:
            codes = torch.randint(0, 16, tensor.shape, generator=torch.Generator().manual_seed(len(name)))
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
            group = (tensor.float().abs().reshape(tensor.shape[0], -1, 16).amax(-1) / 6 + 1e-3).to(FP8)
            tensor_scale = torch.tensor(0.5)
            meant[name] = torch.tensor(E2M1_VALUES)[codes] * group.float().repeat_interleave(16, -1) * tensor_scale
            if scheme == "nvfp4-modelopt":
                stored.update(
                    {
                        name: packed,
                        f"{base}.weight_scale": group,
                        f"{base}.weight_scale_2": tensor_scale,
                        f"{base}.input_scale": torch.tensor(1.0),
                    }
                )
            else:
                stored.update(
                    {
                        f"{base}.weight_packed": packed,
                        f"{base}.weight_scale": group,
                        f"{base}.weight_global_scale": 1.0 / tensor_scale,
                    }
                )
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "activation_scheme": "dynamic"},
        "nvfp4-modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        "nvfp4-ct": {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"]}},
        },
    }[scheme]
    (out / "config.json").write_text(json.dumps(config))
    return meant


@pytest.mark.parametrize(
    ("scheme", "recorded"),
    [
        ("fp8", "safetensors fp8-e4m3 blocks 32x32"),
        ("nvfp4-modelopt", "safetensors nvfp4 (modelopt)"),
        ("nvfp4-ct", "safetensors compressed-tensors nvfp4-pack-quantized"),
    ],
)
def test_quantized_checkpoint_exports_its_dequantized_weights(
    tiny_checkpoint: Path, tmp_path: Path, scheme: str, recorded: str
) -> None:
    meant = _quantized_copy(tiny_checkpoint, tmp_path / "quantized", scheme)
    checkpoint = open_source(str(tmp_path / "quantized"))
    assert checkpoint.source_format == recorded and checkpoint.dtype == "float32"  # the tiny config declares it
    assert set(checkpoint.tensors) == set(meant)
    for name, value in meant.items():
        assert torch.equal(checkpoint.tensors[name], value.float()), name
    core = tmp_path / "core"
    export_core(checkpoint, load_recipe("smollm2"), ExportOptions(out=core))  # the self-check runs on these weights
    assert Core.open(core).manifest.model.source.format == recorded


def test_unknown_quantization_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match="quantization 'awq' is not supported"):
        open_source(str(tmp_path / "awq"))


def test_scale_without_its_weight_type_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    _quantized_copy(tiny_checkpoint, tmp_path / "q", "fp8")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    victim = next(n for n in tensors if n.endswith("_scale_inv"))
    del tensors[victim]
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(SourceError, match="float8_e4m3fn with no scale"):
        open_source(str(tmp_path / "q"))


def test_sharded_checkpoint_reads_its_index(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shards = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoint, shards, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, str(shards / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in parts.items() for n in part}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"stray": torch.zeros(1)}, str(shards / "consolidated.safetensors"))  # not in the index: not read
    checkpoint = open_source(str(shards))
    assert set(checkpoint.tensors) == set(names) and checkpoint.source_format == "safetensors"
    (shards / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match="1 of the 2 shards .* are missing .*finish the download"):
        open_source(str(shards))
