"""GLM-5.3 vision cores: a tiny multimodal checkpoint (`ignition testmodel glm5_next --vision`: a
2-block vision tower over 14-pixel patches of 2 frames with q/k RMSNorm and a 2-D rotary, clamped
SwiGLU MLPs, 2 x 2 Conv2d downsampling and the SwiGLU merger, fit_and_pad bounds of 4 .. 64 tokens,
around the tiny KDA + DSA hybrid text model) exported with its vision program, checked against
transformers' Glm5NextImageProcessor + Glm5NextProcessor (helios' fit_and_pad profile: pixel values,
grid and the placeholder's expansion), Glm5NextModel.get_image_features (the vision program) and
Glm5NextForConditionalGeneration (logprobs with an image in the prompt), on a PNG that is only
padded, a JPEG scaled down to max_image_tokens and a WebP scaled up to min_image_tokens and padded.

transformers' Glm5NextImageProcessor is torchvision-backed and imports torchvision at module level.
Where torchvision is not installed (the project does not depend on it), the module is imported
against a stand-in for torchvision.transforms.v2.functional (test_minimax_m3_vision's: torch's own
antialiased bicubic interpolate on the uint8 image, plain-torch normalize) plus a zero pad; the
processor's class check of its absent video processor is skipped. The resize rule, the padding,
the rescale/normalize fusion, the patch order, the temporal repeat and the placeholder expansion
are transformers' own code either way.
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
from ignition.models import glm5_next
from tests.ignition.processor_standin import bicubic_processor, encode, import_processing
from tests.ignition.vision_checks import check_features_and_logprobs, check_reference_tower, export_tiny_vision

TOLERANCE = 1e-3
# (width, height, format, PIL save options) and the fit_and_pad branch each takes under 4 .. 64 tokens of 28 x 28.
SHAPES = (
    (150, 60, "PNG", {}),  # canvas 168 x 84 (3 x 6 tokens), the image kept at its size and zero-padded
    (300, 200, "JPEG", {"quality": 90}),  # 308 x 224 is over 64 tokens: cut to 252 x 168 (6 x 9), scaled down
    (20, 15, "WEBP", {"lossless": True}),  # one token is under 4: canvas 84 x 56, scaled up to 74 x 56 and padded
)
PROMPT = "Describe this picture: <|begin_of_image|><|image|><|end_of_image|> in short."


def encoded_images() -> list[bytes]:
    return [encode(*shape) for shape in SHAPES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return export_tiny_vision("glm5_next", "glm53", "glm53-vision", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]):
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(
        str(tiny[0]), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def reference_processor(checkpoint: Path):
    """transformers' Glm5NextProcessor (image processor + the checkpoint's tokenizer), on torchvision where it
    imports, else on the torch stand-ins (tests/ignition/processor_standin.py)."""
    return bicubic_processor(
        ("glm5_next.image_processing_glm5_next", "glm5_next.processing_glm5_next"),
        "Glm5NextProcessor",
        "Glm5NextImageProcessor",
        glm5_next.TESTMODEL_PROCESSOR,
        checkpoint,
        patch_image_processing=True,
    )


def pixel_inputs(processed) -> dict[str, Any]:
    """The processor outputs Glm5NextForConditionalGeneration takes for images."""
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
        "fit_and_pad",
        "torch_bicubic",
        14,
        2,
        2,
    )
    assert (v.min_pixels, v.max_pixels) == (4 * 28 * 28, 64 * 28 * 28)
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == 64 and v.max_patches == 256
    assert v.max_image_tokens_per_prompt == m.limits.max_model_len - 3
    tok = core.tokenizer()
    # The template frames each image itself: the placeholder expands to image tokens only.
    assert v.placeholder_token_id == v.image_token_id == tok.token_to_id("<|image|>")
    assert v.prefix_token_ids == v.suffix_token_ids == ()
    assert m.programs[VISION].inputs[0].shape == ("X", 3 * 2 * 14 * 14)
    names = [t.name for t in m.programs[STEP].inputs]
    assert "state_slots" in names and names[-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE
    assert m.decode_weight_bytes < sum(
        t.numel() * 4 for n, t in core.load_weights().items() if not n.startswith("vision.")
    )


def test_preparation_matches_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the grid, every patch row (pixel values, 1e-5, the padding included) and its
    position, the token count and the placeholder's expansion equal what Glm5NextProcessor makes of
    the framed '<|image|>' and the image."""
    from transformers.vision_utils import get_vision_position_ids

    profile = Core.open(tiny[1]).manifest.vision
    assert profile is not None
    tok = Core.open(tiny[1]).tokenizer()
    begin, end = tok.token_to_id("<|begin_of_image|>"), tok.token_to_id("<|end_of_image|>")
    padded = []
    for data, (width, height, fmt, _) in zip(encoded_images(), SHAPES):
        header = images.read_header(data, profile, "image 1")
        assert (header.format, header.width, header.height) == (fmt, width, height)
        cost = images.cost(header.width, header.height, profile)
        processed = processor(
            text="<|begin_of_image|><|image|><|end_of_image|>",
            images=[Image.open(io.BytesIO(data))],
            return_tensors="pt",
        )
        grid = processed["image_grid_thw"]
        assert grid.tolist() == [[1, cost.height // 14, cost.width // 14]], (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == 1
        pixels, positions = views[0]
        assert pixels.shape == processed["pixel_values"].shape == (cost.num_patches, 3 * 2 * 14 * 14)
        assert float((pixels - processed["pixel_values"]).abs().max()) <= 1e-5
        yx = get_vision_position_ids(grid, 2)  # (y, x) in the tower's order
        assert positions.tolist() == yx[:, [1, 0]].tolist()
        ids, runs = images.token_layout(cost, profile)
        assert [begin, *ids, end] == processed["input_ids"][0].tolist()
        assert (
            cost.num_tokens
            == cost.num_patches // 4
            == sum(rows for _, rows in runs)
            == ids.count(profile.image_token_id)
        )
        padded.append(images.fit_and_pad(width, height, profile)[2:] != (cost.height, cost.width))
    assert padded == [True, False, True]


def test_features_and_logprobs_match_transformers(tiny: tuple[Path, Path], reference, processor) -> None:
    check_features_and_logprobs(
        tiny[1], reference, processor, PROMPT, encoded_images(), pixel_inputs, chunk=11, tolerance=TOLERANCE
    )


def test_reference_tower_matches_the_program_on_the_example_grid(tiny: tuple[Path, Path]) -> None:
    """The exported program and the float64 reference agree on the export's example view (the
    self-check's input)."""
    check_reference_tower("glm5_next", tiny)


def test_text_only_configs_stay_text_only(tiny: tuple[Path, Path]) -> None:
    """Without an image token inside the vocabulary (the text test model, or a nested config whose
    vision_config has no image_token_id) the tower is left out, its tensors ignored, as before."""
    config = json.loads((tiny[0] / "config.json").read_text())
    assert glm5_next.config_from_hf(config).vision is not None
    text_only = glm5_next.config_from_hf(config | {"image_token_id": 10**6})
    assert text_only.vision is None and glm5_next.ignored_tensor(text_only, "model.visual.blocks.0.norm1.weight")
    assert glm5_next.config_from_hf(glm5_next.testmodel_config(300)).vision is None


def test_fit_and_pad_matches_the_reference_over_many_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """helios' fit_and_pad (the cost of every image, from its header, and the content size it is
    resized to before padding) equals transformers' smart_resize and Glm5NextImageProcessor.resize
    on sizes that take each branch: inside the bounds, over max_image_tokens, under
    min_image_tokens, a side under one patch and extreme aspect ratios."""
    import transformers.image_processing_backends as backends

    (image_processing,), _ = import_processing(("glm5_next.image_processing_glm5_next",))
    profile = _profile()
    resized: list[tuple[int, int]] = []

    def record(self, image, size, resample=None, **kwargs):  # the backend's resize: only the size matters here
        resized.append((size.height, size.width))
        return image.new_zeros(*image.shape[:-2], size.height, size.width)

    monkeypatch.setattr(backends.TorchvisionBackend, "resize", record)
    processor = image_processing.Glm5NextImageProcessor(min_image_tokens=4, max_image_tokens=64)
    sizes = [(w, h) for w in (1, 13, 14, 27, 40, 150, 300, 333, 1000, 2048) for h in (1, 15, 28, 60, 200, 719, 4000)]
    for width, height in sizes:
        expected = image_processing.smart_resize(
            2, height, width, temporal_factor=2, factor=28, min_pixels=4, max_pixels=64
        )
        th, tw, ch, cw = images.fit_and_pad(width, height, profile)
        cost = images.cost(width, height, profile)
        assert (th, tw) == (cost.height, cost.width) == expected, (width, height)
        assert cost.num_tokens == th * tw // 28**2 == cost.num_patches // 4
        resized.clear()
        out = processor.resize(
            torch.zeros(1, 3, height, width, dtype=torch.uint8),
            resample=3,
            factor=28,
            temporal_factor=2,
            min_image_tokens=4,
            max_image_tokens=64,
        )
        assert tuple(out.shape[-2:]) == (th, tw), (width, height)
        assert (resized or [(height, width)]) == [(ch, cw)], (width, height)


def _profile():
    from helios.core import manifest as mf

    return mf.VisionProfile(
        resize="fit_and_pad",
        patch_size=14,
        pooling_kernel_size=2,
        max_patches=256,
        resample="torch_bicubic",
        rescale_factor=1 / 255,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        placeholder_token_id=6,
        image_token_id=6,
        prefix_token_ids=(),
        suffix_token_ids=(),
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
