"""MiniMax M3 vision cores: a tiny multimodal checkpoint (`ignition testmodel minimax_m3 --vision`: a
2-layer vision tower over 14-pixel patches of 2 frames with a partial 3-D rotary, 2 x 2 merging,
the two-stage GELU projector, smart_resize bounds of 4 .. 64 tokens) exported with its vision
program, checked against transformers' MiniMaxM3VLImageProcessor + MiniMaxM3VLProcessor (helios'
smart_resize profile: pixel values, grid and the placeholder's expansion),
MiniMaxM3VLModel.get_image_features (the vision program) and
MiniMaxM3SparseForConditionalGeneration (logprobs with an image in the prompt), on a PNG that
resizes within the bounds, a JPEG scaled down to max_pixels and a WebP scaled up to min_pixels.

transformers' MiniMaxM3VLImageProcessor is torchvision-backed and imports torchvision at module
level. Where torchvision is not installed (the project does not depend on it), the module is
imported against a stand-in for torchvision.transforms.v2.functional whose resize is torch's own
antialiased bicubic interpolate on the uint8 image (what torchvision's CPU resize calls for bicubic
uint8 images, natively on every CPU) and whose normalize is plain torch; the processor's class
check of its absent video processor is skipped. smart_resize, the rescale/normalize fusion, the
patch order, the temporal repeat and the framing are transformers' own code either way.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from helios.core import Core
from helios.core.program import STEP, VISION
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import minimax_m3
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition.processor_standin import bicubic_processor, encode, import_processing
from tests.ignition.vision_checks import check_features_and_logprobs, check_reference_tower, export_tiny_vision

TOLERANCE = 1e-3
# (width, height, format, PIL save options) and the smart_resize branch each takes under 3136 .. 50176 pixels.
SHAPES = (
    (150, 60, "PNG", {}),  # sides rounded to 140 x 56, inside the bounds: 2 x 5 tokens
    (300, 200, "JPEG", {"quality": 90}),  # 308 x 196 is over max_pixels: scaled down to 252 x 168, 6 x 9 tokens
    (40, 30, "WEBP", {"lossless": True}),  # 28 x 28 is under min_pixels: scaled up to 84 x 56, 2 x 3 tokens
)
PROMPT = "Describe this picture: ]<]image[>[ in short."


def encoded_images() -> list[bytes]:
    return [encode(*shape) for shape in SHAPES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return export_tiny_vision("minimax_m3", "minimax_m3", "minimax-m3-vision", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        str(tiny[0]), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def reference_processor(checkpoint: Path):
    """transformers' MiniMaxM3VLProcessor (image processor + the checkpoint's tokenizer), on torchvision where it
    imports, else on the torch stand-ins (tests/ignition/processor_standin.py)."""
    return bicubic_processor(
        ("minimax_m3_vl.image_processing_minimax_m3_vl", "minimax_m3_vl.processing_minimax_m3_vl"),
        "MiniMaxM3VLProcessor",
        "MiniMaxM3VLImageProcessor",
        minimax_m3.TESTMODEL_PROCESSOR,
        checkpoint,
    )


def pixel_inputs(processed) -> dict[str, Any]:
    """The processor outputs MiniMaxM3SparseForConditionalGeneration takes for images."""
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
        "smart_resize",
        "torch_bicubic",
        14,
        2,
        2,
    )
    assert (v.min_pixels, v.max_pixels) == (4 * 28 * 28, 64 * 28 * 28)
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == 64 and v.max_patches == 256
    assert v.max_image_tokens_per_prompt == m.limits.max_model_len - 3
    assert v.max_images_per_prompt == (m.limits.max_model_len - 1) // (4 + 2)
    tok = core.tokenizer()
    assert v.placeholder_token_id == v.image_token_id == tok.token_to_id("]<]image[>[")
    assert v.prefix_token_ids == (tok.token_to_id("]<]start of image[>["),)
    assert v.suffix_token_ids == (tok.token_to_id("]<]end of image[>["),)
    assert m.programs[VISION].inputs[0].shape == ("X", 3 * 2 * 14 * 14)
    assert [t.name for t in m.programs[STEP].inputs][-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE
    assert m.decode_weight_bytes < sum(
        t.numel() * 4 for n, t in core.load_weights().items() if not n.startswith("vision.")
    )


def test_preparation_matches_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the grid, every patch row (pixel values, 1e-5) and its position, the token count
    and the placeholder's expansion equal what MiniMaxM3VLProcessor makes of ']<]image[>[' and the image."""
    from transformers.vision_utils import get_vision_position_ids

    profile = Core.open(tiny[1]).manifest.vision
    assert profile is not None
    for data, (width, height, fmt, _) in zip(encoded_images(), SHAPES):
        header = images.read_header(data, profile, "image 1")
        assert (header.format, header.width, header.height) == (fmt, width, height)
        cost = images.cost(header.width, header.height, profile)
        processed = processor(text="]<]image[>[", images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        grid = processed["image_grid_thw"]
        assert grid.tolist() == [[1, cost.height // 14, cost.width // 14]], (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == 1
        pixels, positions = views[0]
        assert pixels.shape == processed["pixel_values"].shape == (cost.num_patches, 3 * 2 * 14 * 14)
        assert float((pixels - processed["pixel_values"]).abs().max()) <= 1e-5
        thw = get_vision_position_ids(grid, 2, include_temporal=True)  # (frame, y, x) in the tower's order
        assert thw[:, 0].eq(0).all() and positions.tolist() == thw[:, [2, 1]].tolist()
        ids, runs = images.token_layout(cost, profile)
        assert ids == processed["input_ids"][0].tolist()
        assert (
            cost.num_tokens
            == cost.num_patches // 4
            == sum(rows for _, rows in runs)
            == ids.count(profile.image_token_id)
        )


def test_features_and_logprobs_match_transformers(tiny: tuple[Path, Path], reference, processor) -> None:
    check_features_and_logprobs(
        tiny[1], reference, processor, PROMPT, encoded_images(), pixel_inputs, chunk=11, tolerance=TOLERANCE
    )


def test_minimax_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """MiniMax's own layout (vision_tower.vision_model.*, patch_merge_mlp.*, language_model.*) exports
    to the same core weights as transformers' names; a text-only config refuses vision tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ignition.errors import SourceError

    renames = (
        ("model.vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
        ("model.vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
        ("model.vision_tower.pre_layrnorm.", "vision_tower.vision_model.pre_layrnorm."),
        ("model.multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
    )
    source = tmp_path / "hub"
    shutil.copytree(tiny[0], source)
    tensors = {}
    for name, t in load_file(str(tiny[0] / "model.safetensors")).items():
        for ours, theirs in renames:
            if name.startswith(ours):
                name = theirs + name[len(ours) :]
                break
        tensors[name] = t
    assert (
        "patch_merge_mlp.linear_1.weight" in tensors
        and "vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias" in tensors
    )
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "core"
    export_core(open_source(str(source)), load_recipe("minimax_m3"), ExportOptions(out=out, dtype="float32"))
    ours, theirs = Core.open(out).load_weights(), Core.open(tiny[1]).load_weights()
    assert ours.keys() == theirs.keys() and any(n.startswith("vision.merge1") for n in ours)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    config = json.loads((source / "config.json").read_text())
    config["image_token_id"] = 10**6  # outside the vocabulary: a text-only reading
    (source / "config.json").write_text(json.dumps(config))
    assert minimax_m3.config_from_hf(config).vision is None
    with pytest.raises(SourceError, match="vision tensors in a checkpoint whose config is not multimodal"):
        export_core(open_source(str(source)), load_recipe("minimax_m3"), ExportOptions(out=tmp_path / "text"))


def test_reference_tower_matches_the_program_on_the_example_grid(tiny: tuple[Path, Path]) -> None:
    """The exported program and the float64 reference agree on the export's example view, whose
    frames repeat one image (the self-check's input)."""
    check_reference_tower("minimax_m3", tiny)


def test_smart_resize_costs_match_the_reference_over_many_sizes() -> None:
    """helios' smart_resize (the cost of every image, from its header) equals transformers' on sizes
    that take each branch: inside the bounds, over max_pixels, under min_pixels, a side under half a
    token, extreme aspect ratios (a side floored to one token) and a ratio over 200 (refused)."""
    (image_processing,), _ = import_processing(("minimax_m3_vl.image_processing_minimax_m3_vl",))
    profile = _profile()
    sizes = [(w, h) for w in (1, 13, 14, 27, 40, 150, 300, 333, 1000, 2048) for h in (1, 15, 28, 60, 200, 719, 4000)]
    for width, height in sizes:
        try:
            expected = image_processing.smart_resize(
                height, width, factor=28, min_pixels=profile.min_pixels, max_pixels=profile.max_pixels
            )
        except ValueError:
            with pytest.raises(images.ImageError, match="aspect ratio is over 200"):
                images.cost(width, height, profile)
            continue
        cost = images.cost(width, height, profile)
        assert (cost.height, cost.width) == expected, (width, height)
        assert cost.num_tokens == expected[0] * expected[1] // 28**2 == cost.num_patches // 4


def _profile():
    from helios.core import manifest as mf

    return mf.VisionProfile(
        resize="smart_resize",
        patch_size=14,
        pooling_kernel_size=2,
        max_patches=256,
        resample="torch_bicubic",
        rescale_factor=1 / 255,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        placeholder_token_id=6,
        image_token_id=6,
        prefix_token_ids=(8,),
        suffix_token_ids=(9,),
        feature_dim=64,
        max_images_per_prompt=10,
        max_image_tokens_per_prompt=100,
        image_feature_window_tokens=64,
        max_image_tokens_per_image=64,
        max_image_pixels=10**8,
        max_image_bytes=1 << 20,
        min_pixels=4 * 784,
        max_pixels=64 * 784,
        temporal_patch_size=2,
    )


def test_older_profiles_read_unchanged() -> None:
    """A profile written before the smart_resize fields decodes with them zero, and the prefix
    digests of the other rules are what they were (the new fields join the digest only under
    smart_resize)."""
    import hashlib

    import msgspec

    from helios.core import manifest as mf

    raw = msgspec.json.decode(msgspec.json.encode(_profile()))
    older = {k: v for k, v in raw.items() if k not in ("min_pixels", "max_pixels", "temporal_patch_size")}
    older |= {"resize": "aspect_ratio_patch_budget", "resample": "bicubic"}
    profile = msgspec.json.decode(msgspec.json.encode(older), type=mf.VisionProfile)
    assert (profile.min_pixels, profile.max_pixels, profile.temporal_patch_size) == (0, 0, 0)
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
    assert _profile().settings_digest() != msgspec.structs.replace(_profile(), max_pixels=32 * 784).settings_digest()
