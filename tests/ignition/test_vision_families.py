"""What every vision family's tiny multimodal core must do, parametrized over tests/ignition/vision_cases.py:
declare its image profile; prepare images as transformers' processor does (pixel values, grid, positions
and the placeholder's expansion); give transformers' image features and logprobs with images in the
prompt (get_image_features and the ForConditionalGeneration forward as the oracle); agree with the
family's float64 reference tower; read a text-only config without the tower. What only one family
has is in its own tests/ignition/test_<family>_vision.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignition.models.patch_grid import block_order
from tests.ignition.vision_cases import CASES, PROCESSED, VisionCase
from tests.ignition.vision_checks import (
    check_export_profile,
    check_features_and_logprobs,
    check_preparation,
    check_reference_tower,
    check_text_only_refuses_vision_tensors,
    processor,  # noqa: F401  (module fixtures over `case`)
    reference,  # noqa: F401
    tiny,  # noqa: F401
)

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest) -> VisionCase:
    return request.param


def cases(*families: str) -> pytest.MarkDecorator:
    """Parametrize over the named families' cases (the module's fixtures follow)."""
    return pytest.mark.parametrize("case", [CASES[f] for f in families], indirect=True, ids=str)


every = cases(*CASES)
processed = cases(*(case.family for case in PROCESSED))


@every
def test_export_declares_the_vision_profile(case: VisionCase, tiny: tuple[Path, Path]) -> None:
    check_export_profile(case, tiny[1])


@cases("glm5_next", "kimi_k3", "minimax_m3", "muse_spark")
def test_preparation_matches_the_reference_processor(case: VisionCase, tiny: tuple[Path, Path], processor) -> None:
    """transformers lays patches out in merge blocks (glm5_next, minimax_m3), row-major (kimi_k3), or
    row-major with frame-major pixels (muse_spark); helios in merge blocks, channel-major."""
    check_preparation(case, tiny[1], processor)


@processed
def test_features_and_logprobs_match_transformers(
    case: VisionCase, tiny: tuple[Path, Path], reference, processor
) -> None:
    check_features_and_logprobs(case, tiny[1], reference, processor)


# Kimi K2.5's program also serves a grid larger than its learned position table (8 x 8).
LARGER_VIEWS = {"kimi_k3": ((torch.randn(10 * 12, 3 * 14 * 14), block_order(10, 12, 2)),)}


@every
def test_reference_tower_matches_the_program_on_the_example_grid(case: VisionCase, tiny: tuple[Path, Path]) -> None:
    """The exported program and the float64 reference agree on the export's example view (the
    self-check's input; for the Qwen2-VL-style towers its frames repeat one image)."""
    check_reference_tower(case.family, tiny, LARGER_VIEWS.get(case.family, ()))


@cases("kimi_k3", "minimax_m3", "muse_spark")
def test_text_only_config_refuses_vision_tensors(case: VisionCase, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """An image token id outside the vocabulary (muse_spark: `text_only: true`, the text test
    checkpoints' marker) reads as text-only, and export refuses the tower's tensors by name."""
    check_text_only_refuses_vision_tensors(case, tiny[0], tmp_path)
