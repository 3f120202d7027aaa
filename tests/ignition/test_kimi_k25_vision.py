"""Kimi K2.5 vision cores (kimi_k3 family): a tiny multimodal checkpoint (`ignition testmodel kimi_k3
--vision`: a 2-layer vision tower over 14-pixel patches with an 8 x 8 learned position table and a
2-D rotary, 2 x 2 merging, the LayerNorm + GELU MLP projector; at most 64 patches and 16 a side
before padding) exported with its vision program, checked against transformers'
Kimi_K25ImageProcessor + Kimi_K25Processor (helios' navit profile: pixel values, grid and the
placeholder's expansion), Kimi_K25Model.get_image_features (the vision program) and
Kimi_K25ForConditionalGeneration (logprobs with an image in the prompt), on a PNG padded without
resizing, a JPEG scaled down to the patch budget and a WebP scaled down to the per-side limit.

transformers' Kimi_K25ImageProcessor is torchvision-backed and imports torchvision at module level.
Where torchvision is not installed (the project does not depend on it), the module is imported
against a stand-in for torchvision.transforms.v2.functional whose resize is torch's own antialiased
bicubic interpolate on the uint8 image (what torchvision's CPU resize calls for bicubic uint8
images), whose pad is torch's constant pad and whose normalize is plain torch; the processor's class
check of its absent video processor is skipped. navit_resize, the padding, the rescale/normalize
fusion, the patch order and the placeholder expansion are transformers' own code either way.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from helios.core import Core
from helios.core.program import STEP, VISION
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import deepseek_v3
from ignition.models.patch_grid import block_order
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition.processor_standin import bicubic_processor, encode, import_processing
from tests.ignition.vision_checks import check_features_and_logprobs, check_reference_tower, export_tiny_vision

TOLERANCE = 1e-3
# (width, height, format, PIL save options) and the navit branch each takes under 64 patches, 16 a side.
SHAPES = (
    (150, 60, "PNG", {}),  # 10 x 4 patches, kept: padded to 168 x 84, 6 x 3 tokens
    (300, 200, "JPEG", {"quality": 90}),  # 21 x 14 patches: scaled to 139 x 93, padded to 140 x 112, 5 x 4 tokens
    (40, 400, "WEBP", {"lossless": True}),  # 28 patches high: scaled to 22 x 224, padded to 28 x 224, 1 x 8 tokens
)
FRAMED = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"  # what K2.5's template renders
PROMPT = f"Describe this picture: {FRAMED} in short."


def encoded_images() -> list[bytes]:
    return [encode(*shape) for shape in SHAPES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return export_tiny_vision("kimi_k3", "kimi3", "kimi-k25-vision", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]):
    from transformers import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(tiny[0]), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def reference_processor(checkpoint: Path):
    """transformers' Kimi_K25Processor (image processor + the checkpoint's tokenizer), on torchvision where it
    imports, else on the torch stand-ins (tests/ignition/processor_standin.py)."""
    return bicubic_processor(
        ("kimi_k25.image_processing_kimi_k25", "kimi_k25.processing_kimi_k25"),
        "Kimi_K25Processor",
        "Kimi_K25ImageProcessor",
        deepseek_v3.TESTMODEL_PROCESSOR,
        checkpoint,
        patch_image_processing=True,
    )


def pixel_inputs(processed) -> dict[str, Any]:
    """The processor outputs Kimi_K25ForConditionalGeneration takes for images."""
    return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}


@pytest.fixture(scope="module")
def processor(tiny: tuple[Path, Path]):
    with reference_processor(tiny[0]) as made:
        yield made


def test_export_declares_the_vision_profile(tiny: tuple[Path, Path]) -> None:
    core = Core.open(tiny[1])
    m = core.manifest
    assert m.capabilities.vision and VISION in m.programs and m.vision is not None
    v = m.vision
    assert (v.resize, v.resample, v.patch_size, v.pooling_kernel_size, v.temporal_patch_size) == (
        "navit",
        "torch_bicubic",
        14,
        2,
        0,
    )
    assert (v.patch_budget, v.max_side_patches, v.min_pixels, v.max_pixels) == (64, 16, 0, 0)
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == 64 // 4 + 16 // 2 + 1
    assert v.max_patches == 4 * v.max_image_tokens_per_image
    tok = core.tokenizer()
    assert v.placeholder_token_id == tok.token_to_id("<|kimi_image_placeholder|>")
    assert v.image_token_id == tok.token_to_id("<|media_pad|>")
    assert v.prefix_token_ids == tuple(tok.token_to_id(t) for t in ("<|media_begin|>", "image", "<|media_content|>"))
    assert v.suffix_token_ids == (tok.token_to_id("<|media_end|>"),)
    assert v.max_image_tokens_per_prompt == m.limits.max_model_len - 1 - 4
    assert v.max_images_per_prompt == (m.limits.max_model_len - 1) // (2 + 4)
    assert m.programs[VISION].inputs[0].shape == ("X", 3 * 14 * 14)
    assert [t.name for t in m.programs[STEP].inputs][-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE
    text_bytes = sum(t.numel() * 4 for n, t in core.load_weights().items() if not n.startswith("vision."))
    assert m.decode_weight_bytes < text_bytes


def test_preparation_matches_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the grid, every patch row (pixel values, 1e-5) at its position (transformers lays
    patches out row-major, helios in merge blocks), the token count and the placeholder's expansion
    equal what Kimi_K25Processor makes of K2.5's framed <|media_pad|> and the image."""
    profile = Core.open(tiny[1]).manifest.vision
    assert profile is not None
    for data, (width, height, fmt, _) in zip(encoded_images(), SHAPES):
        header = images.read_header(data, profile, "image 1")
        assert (header.format, header.width, header.height) == (fmt, width, height)
        cost = images.cost(header.width, header.height, profile)
        processed = processor(text=FRAMED, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        rows, cols = cost.height // 14, cost.width // 14
        assert processed["image_grid_thw"].tolist() == [[1, rows, cols]], (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == 1
        pixels, positions = views[0]
        theirs = processed["pixel_values"].reshape(rows * cols, -1)  # [X, 3 * 14 * 14] row-major, (c, y, x) pixels
        assert pixels.shape == theirs.shape == (cost.num_patches, 3 * 14 * 14)
        raster = positions[:, 1] * cols + positions[:, 0]
        assert sorted(raster.tolist()) == list(range(rows * cols))
        assert float((pixels - theirs[raster]).abs().max()) <= 1e-5
        assert positions.tolist() == block_order(rows, cols, 2).tolist()
        ids, runs = images.token_layout(cost, profile)
        assert ids == processed["input_ids"][0].tolist()
        assert cost.num_tokens == cost.num_patches // 4 == sum(r for _, r in runs) == ids.count(profile.image_token_id)


def test_features_and_logprobs_match_transformers(tiny: tuple[Path, Path], reference, processor) -> None:
    check_features_and_logprobs(
        tiny[1], reference, processor, PROMPT, encoded_images(), pixel_inputs, chunk=11, tolerance=TOLERANCE
    )


def test_reference_tower_matches_the_program_on_the_example_grid(tiny: tuple[Path, Path]) -> None:
    """The exported program and the float64 reference agree on the export's example view (the
    self-check's input), and the program serves a grid larger than the learned position table."""
    check_reference_tower("kimi_k3", tiny, ((torch.randn(10 * 12, 3 * 14 * 14), block_order(10, 12, 2)),))


def test_navit_costs_match_the_reference_over_many_sizes() -> None:
    """helios' navit_resize (every image's cost, from its header) equals transformers' on sizes that
    keep, scale by the patch budget, scale by the side limit, and sides under one patch."""
    (image_processing,), _ = import_processing(("kimi_k25.image_processing_kimi_k25",))
    profile = _profile()
    sizes = [(w, h) for w in (1, 13, 14, 27, 40, 150, 300, 333, 1000, 2048) for h in (1, 15, 28, 60, 200, 719, 4000)]
    for width, height in sizes:
        expected = image_processing.navit_resize(
            height, width, patch_size=14, merge_kernel_size=2, max_patches=64, max_size_per_side=16
        )
        assert images.navit_resize(width, height, profile) == expected, (width, height)
        cost = images.cost(width, height, profile)
        assert (cost.height, cost.width) == expected[1]
        assert cost.num_tokens == expected[1][0] * expected[1][1] // 28**2 == cost.num_patches // 4


def _profile():
    from helios.core import manifest as mf

    return mf.VisionProfile(
        resize="navit",
        patch_size=14,
        pooling_kernel_size=2,
        max_patches=100,
        resample="torch_bicubic",
        rescale_factor=1 / 255,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        placeholder_token_id=4,
        image_token_id=8,
        prefix_token_ids=(5, 9, 6),
        suffix_token_ids=(7,),
        feature_dim=64,
        max_images_per_prompt=10,
        max_image_tokens_per_prompt=100,
        image_feature_window_tokens=25,
        max_image_tokens_per_image=25,
        max_image_pixels=10**8,
        max_image_bytes=1 << 20,
        patch_budget=64,
        max_side_patches=16,
    )


def test_older_profiles_read_unchanged() -> None:
    """A profile written before the navit fields decodes with them zero, and the digests of the other
    rules are what they were (the new fields join the digest only under navit)."""
    import hashlib

    import msgspec

    from helios.core import manifest as mf

    raw = msgspec.json.decode(msgspec.json.encode(_profile()))
    older = {k: v for k, v in raw.items() if k not in ("patch_budget", "max_side_patches")}
    older |= {"resize": "aspect_ratio_patch_budget", "resample": "bicubic"}
    profile = msgspec.json.decode(msgspec.json.encode(older), type=mf.VisionProfile)
    assert (profile.patch_budget, profile.max_side_patches) == (0, 0)
    fields = (
        profile.resize,
        profile.patch_size,
        profile.pooling_kernel_size,
        profile.max_patches,
        profile.resample,
        profile.rescale_factor,
        profile.image_mean,
        profile.image_std,
    )
    assert profile.settings_digest() == hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()
    assert _profile().settings_digest() != msgspec.structs.replace(_profile(), patch_budget=32).settings_digest()


_TO_HUB = (
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$", "vision_tower.patch_embed.pos_emb.weight"),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^model\.language_model\.", "language_model.model."),
)
_QKV = re.compile(r"^model\.vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")


def _to_hub_layout(tensors: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """transformers' names -> Moonshot's layout, undoing conversion_mapping "kimi_k25": q, k, v fused
    into wqkv with q and k rows back in interleaved-pair order per head, then the renames above."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        qkv = _QKV.match(name)
        if qkv:
            layer, part, kind = qkv.groups()
            if part != "v":
                t = t.reshape(num_heads, 2, t.shape[0] // num_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
            fused.setdefault((layer, kind), {})[part] = t
            continue
        for pattern, replacement in _TO_HUB:
            if re.match(pattern, name):
                name = re.sub(pattern, replacement, name)
                break
        out[name] = t
    for (layer, kind), parts in fused.items():
        out[f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def test_moonshot_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """Moonshot's own layout (fused wqkv with interleaved rotary rows, blocks.N.*, mm_projector.proj.*,
    language_model.model.*) loads in transformers to the tiny checkpoint's tensors (so the layout
    written here is the one its conversion mapping reads) and exports to the same core weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25ForConditionalGeneration

    source = tmp_path / "hub"
    shutil.copytree(tiny[0], source)
    original = load_file(str(tiny[0] / "model.safetensors"))
    hub = _to_hub_layout(original, num_heads=2)
    assert "vision_tower.encoder.blocks.1.wqkv.bias" in hub and "mm_projector.proj.2.weight" in hub
    assert not any(n.startswith("model.") for n in hub)
    save_file(hub, str(source / "model.safetensors"), metadata={"format": "pt"})
    loaded = Kimi_K25ForConditionalGeneration.from_pretrained(str(source), dtype=torch.float32).state_dict()
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny[0]), dtype=torch.float32).state_dict()
    vision_names = [n for n in reference if n.startswith(("model.vision_tower.", "model.mm_projector."))]
    assert vision_names and all(torch.equal(loaded[n], reference[n]) for n in vision_names)
    out = tmp_path / "core"
    export_core(open_source(str(source)), load_recipe("kimi3"), ExportOptions(out=out, dtype="float32"))
    ours, theirs = Core.open(out).load_weights(), Core.open(tiny[1]).load_weights()
    assert ours.keys() == theirs.keys() and any(n.startswith("vision.layers.1.wq") for n in ours)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_text_only_config_refuses_vision_tensors(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """An image token id outside the vocabulary reads as text-only, and its vision tensors are refused."""
    import shutil

    from ignition.errors import SourceError

    source = tmp_path / "text"
    shutil.copytree(tiny[0], source)
    config = json.loads((source / "config.json").read_text())
    config["image_token_id"] = 10**6
    (source / "config.json").write_text(json.dumps(config))
    assert deepseek_v3.config_from_hf(config).vision is None
    with pytest.raises(SourceError, match="vision tensors in a checkpoint whose config is not multimodal"):
        export_core(open_source(str(source)), load_recipe("kimi3"), ExportOptions(out=tmp_path / "core"))
