"""Muse Spark vision cores (tests/ignition/vision_cases.py MUSE, whose shared checks are in
test_vision_families.py): helios' aspect_grid against transformers' MuseGlimmer smart_resize over many
sizes, and the aspect_grid rule's profile (no new fields, its own digest).

transformers' MuseGlimmerImageProcessor asks for LANCZOS, which transformers passes to torchvision >=
0.27 on the CPU and otherwise replaces by bicubic; where torchvision is absent the reference processor
runs on PIL's LANCZOS (tests/ignition/processor_standin.py), reporting a torchvision new enough."""

from __future__ import annotations

import msgspec

from helios.core import manifest as mf
from helios.frontend import images
from tests.ignition.processor_standin import import_processing
from tests.ignition.vision_checks import SIZES, prefix_digest, tiny_profile


def test_aspect_grid_costs_match_the_reference_over_many_sizes() -> None:
    """helios' aspect_grid (the cost of every image, from its header) equals transformers'
    MuseGlimmer smart_resize on sizes inside the cap, over it, tiny, and at extreme aspect ratios
    (where its fallback grid exceeds the cap)."""
    (image_processing,), _ = import_processing(("muse_glimmer.image_processing_muse_glimmer",))
    profile = _profile()
    for width, height in SIZES:
        expected = image_processing.smart_resize(height, width, patch_size=28, max_tokens=64)
        cost = images.cost(width, height, profile)
        assert (cost.height, cost.width) == expected, (width, height)
        # Extreme aspect ratios fall back to the rounded ideal grid, over the cap: refused per request.
        assert cost.num_tokens == expected[0] * expected[1] // 28**2 == cost.num_patches // 4
        assert cost.num_tokens <= 64 or max(width / height, height / width) > 64, (width, height)


def _profile():
    return tiny_profile("aspect_grid", resample="lanczos", temporal_patch_size=2)


def test_the_aspect_grid_rule_adds_no_profile_fields() -> None:
    """aspect_grid reuses max_patches for its cap: no new profile field, so older cores decode as before
    and their prefix digests stay what they were; an aspect_grid digest follows its own settings."""
    profile = _profile()
    assert profile.settings_digest() == prefix_digest(profile)
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
