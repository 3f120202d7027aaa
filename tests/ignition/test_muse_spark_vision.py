"""Muse Spark vision cores: a tiny multimodal checkpoint (`ignition testmodel muse_spark --vision`: a
2-layer vision tower over 14-pixel patches of 2 frames with a 4 x 4 position table, so 4 x 4-patch
attention windows on its window layer, a 2-D axial rotary, 2 x 2 pixel-shuffle merging, the GELU
adapter, the projection and the weightless perception norm; at most 64 tokens per image) exported
with its vision program, checked against transformers' MuseGlimmerImageProcessor + MuseSparkProcessor
(helios' aspect_grid profile: pixel values, grid and the placeholder's expansion),
MuseSparkModel.get_image_features (the vision program) and MuseSparkForConditionalGeneration
(logprobs with an image in the prompt), on a PNG inside the cap, a JPEG scaled down to the cap and a
small WebP scaled up to whole tokens (where two grids tie on aspect error), all non-square
(transformers' transposed position-table sampling only shows there) and over more than one
attention window.

transformers' MuseGlimmerImageProcessor is torchvision-backed and imports torchvision at module level.
Where torchvision is not installed (the project does not depend on it), the module is imported
against a stand-in for torchvision.transforms.v2.functional whose resize is PIL's LANCZOS on each
uint8 image (the processor asks for LANCZOS, which transformers passes to torchvision >= 0.27 on the
CPU and otherwise replaces by bicubic; the stand-in reports a torchvision new enough, and assumes its
uint8 LANCZOS equals PIL's, the filter transformers' warning names as the original) and whose
normalize is plain torch; the processor's class check of its absent video processor is skipped.
The token-capped aspect grid, the rescale/normalize fusion, the patch layout, the temporal repeat and
the framing are transformers' own code either way.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from helios.core import Core
from helios.core.program import STEP, VISION
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import muse_spark
from ignition.models.patch_grid import block_order
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition.processor_standin import Mode, encode, functional, import_processing
from tests.ignition.vision_checks import check_features_and_logprobs, check_reference_tower, export_tiny_vision

TOLERANCE = 1e-3
# (width, height, format, PIL save options) and the aspect grid each takes under the 64-token cap.
SHAPES = (
    (150, 60, "PNG", {}),  # 5.4 x 2.1 tokens: 5 x 2 (140 x 56), inside the cap, 3 windows
    (300, 200, "JPEG", {"quality": 90}),  # 10.7 x 7.1 tokens is over 64: 9 x 6 (252 x 168)
    (40, 70, "WEBP", {"lossless": True}),  # 1.4 x 2.5 tokens: 2 x 3 (56 x 84), tied with 1 x 2 on aspect error
)
PROMPT = "Describe this picture: <|patch|> in short."


def encoded_images() -> list[bytes]:
    return [encode(*shape) for shape in SHAPES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return export_tiny_vision("muse_spark", "muse_spark", "muse-spark-vision", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]):
    from transformers import MuseSparkForConditionalGeneration

    model = MuseSparkForConditionalGeneration.from_pretrained(
        str(tiny[0]), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@contextlib.contextmanager
def reference_processor(checkpoint: Path) -> Iterator[Any]:
    """transformers' MuseSparkProcessor (MuseGlimmerImageProcessor + the checkpoint's tokenizer), on
    torchvision where it imports, else on the stand-ins above."""
    import transformers.image_processing_backends as backends
    from transformers import PreTrainedTokenizerFast
    from transformers.image_utils import PILImageResampling

    (image_processing, processing), real = import_processing(
        ("muse_glimmer.image_processing_muse_glimmer", "muse_spark.processing_muse_spark")
    )
    patch = pytest.MonkeyPatch()
    if not real:
        patch.setattr(backends, "tvF", functional(), raising=False)
        patch.setattr(backends, "pil_torch_interpolation_mapping", {PILImageResampling.LANCZOS: Mode.LANCZOS})
        patch.setattr(backends, "is_torchvision_greater_or_equal", lambda version: True)
        # The class check looks up BaseVideoProcessor, which transformers leaves out without torchvision.
        patch.setattr(processing.MuseSparkProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
    settings = {k: v for k, v in muse_spark.TESTMODEL_PROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    try:
        yield processing.MuseSparkProcessor(
            image_processor=image_processing.MuseGlimmerImageProcessor(**settings), tokenizer=tokenizer
        )
    finally:
        patch.undo()


def pixel_inputs(processed) -> dict[str, Any]:
    """The processor outputs MuseSparkForConditionalGeneration takes for images."""
    return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}


def helios_layout(pixels: torch.Tensor, positions: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """helios' patch rows (merge-block order, (channel, frame, row, col) pixels) in transformers' layout
    (row-major, (frame, channel, row, col) pixels)."""
    out = torch.empty_like(pixels)
    for (x, y), row in zip(positions.tolist(), pixels):
        out[y * cols + x] = row.view(3, 2, -1).transpose(0, 1).reshape(-1)
    return out


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
        "aspect_grid",
        "lanczos",
        14,
        2,
        2,
    )
    assert (v.min_pixels, v.max_pixels, v.patch_budget) == (0, 0, 0)
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == 64 and v.max_patches == 256
    assert v.max_image_tokens_per_prompt == m.limits.max_model_len - 3
    assert v.max_images_per_prompt == (m.limits.max_model_len - 1) // 4
    assert v.image_mean == v.image_std == (0.5, 0.5, 0.5)
    tok = core.tokenizer()
    assert v.placeholder_token_id == v.image_token_id == tok.token_to_id("<|patch|>")
    assert v.prefix_token_ids == (tok.token_to_id("<|image_start|>"),)
    assert v.suffix_token_ids == (tok.token_to_id("<|image_end|>"),)
    assert m.programs[VISION].inputs[0].shape == ("X", 3 * 2 * 14 * 14)
    assert [t.name for t in m.programs[STEP].inputs][-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE
    assert m.decode_weight_bytes < sum(
        t.numel() * 4 for n, t in core.load_weights().items() if not n.startswith("vision.")
    )


def test_preparation_matches_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the grid, every patch row (pixel values, 1e-5, after putting helios' merge-block
    rows back in transformers' raster order and frame-major pixels), the token count and the
    placeholder's expansion equal what MuseSparkProcessor makes of '<|patch|>' and the image."""
    profile = Core.open(tiny[1]).manifest.vision
    assert profile is not None
    for data, (width, height, fmt, _) in zip(encoded_images(), SHAPES):
        header = images.read_header(data, profile, "image 1")
        assert (header.format, header.width, header.height) == (fmt, width, height)
        cost = images.cost(header.width, header.height, profile)
        processed = processor(text="<|patch|>", images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        rows, cols = cost.height // 14, cost.width // 14
        assert processed["image_grid_thw"].tolist() == [[1, rows, cols]], (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == 1
        pixels, positions = views[0]
        assert positions.tolist() == block_order(rows, cols, 2).tolist()
        assert pixels.shape == processed["pixel_values"].shape == (cost.num_patches, 3 * 2 * 14 * 14)
        assert float((helios_layout(pixels, positions, rows, cols) - processed["pixel_values"]).abs().max()) <= 1e-5
        ids, runs = images.token_layout(cost, profile)
        assert ids == processed["input_ids"][0].tolist()
        assert cost.num_tokens == cost.num_patches // 4 == sum(n for _, n in runs) == ids.count(profile.image_token_id)


def test_features_and_logprobs_match_transformers(tiny: tuple[Path, Path], reference, processor) -> None:
    check_features_and_logprobs(
        tiny[1], reference, processor, PROMPT, encoded_images(), pixel_inputs, chunk=7, tolerance=TOLERANCE
    )


def test_reference_tower_matches_the_program_on_the_example_grid(tiny: tuple[Path, Path]) -> None:
    """The exported program and the float64 reference agree on the export's example view (the self-check's input)."""
    check_reference_tower("muse_spark", tiny)


def test_text_only_config_refuses_vision_tensors(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """`text_only: true` (the text test checkpoints' marker) reads no vision config, and export refuses the tower by name."""
    import shutil

    from ignition.errors import SourceError

    source = tmp_path / "text"
    shutil.copytree(tiny[0], source)
    config = json.loads((source / "config.json").read_text()) | {"text_only": True}
    (source / "config.json").write_text(json.dumps(config))
    assert muse_spark.config_from_hf(config).vision is None
    with pytest.raises(SourceError, match="vision tensors in a checkpoint whose config is not multimodal"):
        export_core(open_source(str(source)), load_recipe("muse_spark"), ExportOptions(out=tmp_path / "core"))


def test_aspect_grid_costs_match_the_reference_over_many_sizes() -> None:
    """helios' aspect_grid (the cost of every image, from its header) equals transformers'
    MuseGlimmer smart_resize on sizes inside the cap, over it, tiny, and at extreme aspect ratios
    (where its fallback grid exceeds the cap)."""
    (image_processing,), _ = import_processing(("muse_glimmer.image_processing_muse_glimmer",))
    profile = _profile()
    sizes = [(w, h) for w in (1, 13, 14, 27, 40, 150, 300, 333, 1000, 2048) for h in (1, 15, 28, 60, 200, 719, 4000)]
    for width, height in sizes:
        expected = image_processing.smart_resize(height, width, patch_size=28, max_tokens=64)
        cost = images.cost(width, height, profile)
        assert (cost.height, cost.width) == expected, (width, height)
        # Extreme aspect ratios fall back to the rounded ideal grid, over the cap: refused per request.
        assert cost.num_tokens == expected[0] * expected[1] // 28**2 == cost.num_patches // 4
        assert cost.num_tokens <= 64 or max(width / height, height / width) > 64, (width, height)


def _profile():
    from helios.core import manifest as mf

    return mf.VisionProfile(
        resize="aspect_grid",
        patch_size=14,
        pooling_kernel_size=2,
        max_patches=256,
        resample="lanczos",
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
        temporal_patch_size=2,
    )


def test_the_aspect_grid_rule_adds_no_profile_fields() -> None:
    """aspect_grid reuses max_patches for its cap: no new profile field, so older cores decode as before
    and their prefix digests stay what they were; an aspect_grid digest follows its own settings."""
    import hashlib

    import msgspec

    from helios.core import manifest as mf

    profile = _profile()
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
    older = msgspec.structs.replace(
        profile, resize="aspect_ratio_patch_budget", resample="bicubic", temporal_patch_size=0
    )
    raw = {
        k: v
        for k, v in msgspec.json.decode(msgspec.json.encode(older)).items()
        if k not in ("min_pixels", "max_pixels", "temporal_patch_size", "patch_budget", "max_side_patches")
    }
    assert msgspec.json.decode(msgspec.json.encode(raw), type=mf.VisionProfile) == older
    assert profile.settings_digest() != msgspec.structs.replace(profile, max_patches=128).settings_digest()
    assert profile.settings_digest() != msgspec.structs.replace(profile, resample="bicubic").settings_digest()
