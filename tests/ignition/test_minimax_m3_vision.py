"""MiniMax M3 vision cores (tests/ignition/vision_cases.py MINIMAX, whose shared checks are in
test_vision_families.py): MiniMax's own hub layout of the tower, helios' smart_resize against
transformers' MiniMaxM3VLImageProcessor over many sizes, and profiles written before the smart_resize
fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.frontend import images
from tests.ignition.processor_standin import import_processing
from tests.ignition.vision_cases import MINIMAX
from tests.ignition.vision_checks import (  # noqa: F401  (tiny: the module fixture)
    SIZES,
    case_fixture,
    check_hub_layout,
    check_older_profiles_read_unchanged,
    tiny,
    tiny_profile,
)

# transformers' names -> MiniMax's (the inverse of transformers' conversion_mapping "minimax_m3_vl").
_TO_HUB = (
    ("model.vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
    ("model.vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
    ("model.vision_tower.pre_layrnorm.", "vision_tower.vision_model.pre_layrnorm."),
    ("model.multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
)


case = case_fixture(MINIMAX)


def _to_hub_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        prefix = next((p for p in _TO_HUB if name.startswith(p[0])), None)
        out[prefix[1] + name[len(prefix[0]) :] if prefix else name] = t
    return out


def test_minimax_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """MiniMax's own layout (vision_tower.vision_model.*, patch_merge_mlp.*, language_model.*) exports
    to the same core weights as transformers' names (a text-only config refusing vision tensors:
    test_vision_families.py)."""
    hub = check_hub_layout(MINIMAX, tiny, tmp_path, _to_hub_layout)
    assert "patch_merge_mlp.linear_1.weight" in hub and "vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias" in hub


def test_smart_resize_costs_match_the_reference_over_many_sizes() -> None:
    """helios' smart_resize (the cost of every image, from its header) equals transformers' on sizes
    that take each branch: inside the bounds, over max_pixels, under min_pixels, a side under half a
    token, extreme aspect ratios (a side floored to one token) and a ratio over 200 (refused)."""
    (image_processing,), _ = import_processing(("minimax_m3_vl.image_processing_minimax_m3_vl",))
    profile = _profile()
    for width, height in SIZES:
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
    return tiny_profile("smart_resize", min_pixels=4 * 784, max_pixels=64 * 784, temporal_patch_size=2)


def test_older_profiles_read_unchanged() -> None:
    """A profile written before the smart_resize fields decodes with them zero, and the prefix
    digests of the other rules are what they were (the new fields join the digest only under
    smart_resize)."""
    new_fields = ("min_pixels", "max_pixels", "temporal_patch_size")
    check_older_profiles_read_unchanged(_profile(), new_fields, {"max_pixels": 32 * 784})
