"""GLM-5.3 vision cores (tests/ignition/vision_cases.py GLM, whose shared checks are in
test_vision_families.py): text-only readings that leave the tower out, and helios' fit_and_pad against
transformers' smart_resize and Glm5NextImageProcessor.resize over many sizes.

transformers' Glm5NextImageProcessor is torchvision-backed and imports torchvision at module level;
where torchvision is not installed it is imported against the stand-in of
tests/ignition/processor_standin.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helios.frontend import images
from ignition.models import FAMILIES
from tests.ignition.processor_standin import import_processing
from tests.ignition.vision_cases import GLM
from tests.ignition.vision_checks import SIZES, case_fixture, tiny, tiny_profile  # noqa: F401  (tiny: a fixture)

case = case_fixture(GLM)


def test_text_only_configs_stay_text_only(tiny: tuple[Path, Path]) -> None:
    """Without an image token inside the vocabulary (the text test model, or a nested config whose
    vision_config has no image_token_id) the tower is left out, its tensors ignored, as before."""
    fam = FAMILIES["glm5_next"]
    config = json.loads((tiny[0] / "config.json").read_text())
    assert fam.config_from_hf(config).vision is not None
    text_only = fam.config_from_hf(config | GLM.text_only)
    assert text_only.vision is None and fam.ignored_tensor(text_only, "model.visual.blocks.0.norm1.weight")
    assert fam.config_from_hf(fam.tiny.config(300)).vision is None


def test_fit_and_pad_matches_the_reference_over_many_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """helios' fit_and_pad (the cost of every image, from its header, and the content size it is
    resized to before padding) equals transformers' smart_resize and Glm5NextImageProcessor.resize
    on sizes that take each branch: inside the bounds, over max_image_tokens, under
    min_image_tokens, a side under one patch and extreme aspect ratios; of the test images the first
    and third are padded, the second not."""
    import transformers.image_processing_backends as backends

    (image_processing,), _ = import_processing(("glm5_next.image_processing_glm5_next",))
    profile = tiny_profile(
        "fit_and_pad",
        prefix_token_ids=(),
        suffix_token_ids=(),
        min_pixels=4 * 784,
        max_pixels=64 * 784,
        temporal_patch_size=2,
    )
    resized: list[tuple[int, int]] = []

    def record(self, image, size, resample=None, **kwargs):  # the backend's resize: only the size matters here
        resized.append((size.height, size.width))
        return image.new_zeros(*image.shape[:-2], size.height, size.width)

    monkeypatch.setattr(backends.TorchvisionBackend, "resize", record)
    processor = image_processing.Glm5NextImageProcessor(min_image_tokens=4, max_image_tokens=64)
    for width, height in SIZES:
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
    fits = [images.fit_and_pad(width, height, profile) for width, height, _, _ in GLM.shapes]
    assert [fit[2:] != fit[:2] for fit in fits] == [True, False, True]
