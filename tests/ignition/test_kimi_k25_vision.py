"""Kimi K2.5 vision cores (kimi_k3 family; tests/ignition/vision_cases.py KIMI, whose shared checks are in
test_vision_families.py): helios' navit_resize against transformers' Kimi_K25ImageProcessor over many
sizes, profiles written before the navit fields, and Moonshot's own hub layout of the tower."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from helios.frontend import images
from tests.ignition.processor_standin import import_processing
from tests.ignition.vision_cases import KIMI
from tests.ignition.vision_checks import (  # noqa: F401  (tiny: the module fixture)
    SIZES,
    case_fixture,
    check_hub_layout,
    check_older_profiles_read_unchanged,
    fused_qkv,
    tiny,
    tiny_profile,
)

case = case_fixture(KIMI)


def test_navit_costs_match_the_reference_over_many_sizes() -> None:
    """helios' navit_resize (every image's cost, from its header) equals transformers' on sizes that
    keep, scale by the patch budget, scale by the side limit, and sides under one patch."""
    (image_processing,), _ = import_processing(("kimi_k25.image_processing_kimi_k25",))
    profile = _profile()
    for width, height in SIZES:
        expected = image_processing.navit_resize(
            height, width, patch_size=14, merge_kernel_size=2, max_patches=64, max_size_per_side=16
        )
        assert images.navit_resize(width, height, profile) == expected, (width, height)
        cost = images.cost(width, height, profile)
        assert (cost.height, cost.width) == expected[1]
        assert cost.num_tokens == expected[1][0] * expected[1][1] // 28**2 == cost.num_patches // 4


def _profile():
    return tiny_profile(
        "navit",
        max_patches=100,
        placeholder_token_id=4,
        image_token_id=8,
        prefix_token_ids=(5, 9, 6),
        suffix_token_ids=(7,),
        image_feature_window_tokens=25,
        max_image_tokens_per_image=25,
        patch_budget=64,
        max_side_patches=16,
    )


def test_older_profiles_read_unchanged() -> None:
    """A profile written before the navit fields decodes with them zero, and the digests of the other
    rules are what they were (the new fields join the digest only under navit)."""
    check_older_profiles_read_unchanged(_profile(), ("patch_budget", "max_side_patches"), {"patch_budget": 32})


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
    rest, fused = fused_qkv(tensors, _QKV, num_heads)
    out = {next((re.sub(p, r, name) for p, r in _TO_HUB if re.match(p, name)), name): t for name, t in rest.items()}
    return out | {f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}": t for (layer, kind), t in fused.items()}


def test_moonshot_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """Moonshot's own layout (fused wqkv with interleaved rotary rows, blocks.N.*, mm_projector.proj.*,
    language_model.model.*) loads in transformers to the tiny checkpoint's tensors (so the layout
    written here is the one its conversion mapping reads) and exports to the same core weights."""
    hub = check_hub_layout(
        KIMI,
        tiny,
        tmp_path,
        lambda tensors: _to_hub_layout(tensors, num_heads=2),
        lambda name: name.startswith(("model.vision_tower.", "model.mm_projector.")),
    )
    assert "vision_tower.encoder.blocks.1.wqkv.bias" in hub and "mm_projector.proj.2.weight" in hub
    assert not any(n.startswith("model.") for n in hub)
