"""Step 3.7 vision cores (step5 family; tests/ignition/vision_cases.py STEP, whose shared checks, features
and logprobs against Step3p7ForConditionalGeneration among them, are in test_vision_families.py): the
views and token layout against transformers' Step3p7ImageProcessor + Step3p7Processor on images of
different sizes and formats (no tiles, tiles in one row, tiles in rows with <patch_newline>, an extreme
aspect squared by zero padding, one scaled down to max_image_size); StepFun's hub vision layout reads to
the same core weights as transformers' names; transformers' own config spellings read the same tower.

Where torchvision is not installed (the project does not depend on it) the reference processor's
resize, pad and normalize are the torch stand-ins of tests/ignition/processor_standin.py (bilinear:
torch's antialiased kernel, what torchvision's CPU resize calls on uint8 images). The tiling plan,
crops, their order, the rescale/normalize fusion and the framing are transformers' own code either way.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch
from PIL import Image

from helios.core import Core
from helios.frontend import images
from ignition.models import FAMILIES
from tests.ignition.processor_standin import encode
from tests.ignition.vision_cases import STEP
from tests.ignition.vision_checks import case_fixture, check_hub_layout, fused_qkv, processor, tiny  # noqa: F401  (module fixtures over `case`)

SCALED = (500, 300, "JPEG", {"quality": 85})  # over max_image_size: scaled to 448 x 268 first, 4 x 3 tiles


case = case_fixture(STEP)


def _reference_views(processed) -> list[torch.Tensor]:
    """The processor's views of one image in feature order (tiles, then the global view): [3, S, S] each."""
    tiles = list(processed["pixel_values_local"]) if "pixel_values_local" in processed else []
    return tiles + [processed["pixel_values"][0]]


def _patches(view: torch.Tensor, ps: int) -> torch.Tensor:
    c, s, _ = view.shape
    return view.permute(1, 2, 0).reshape(s // ps, ps, s // ps, ps, c).permute(0, 2, 1, 3, 4).reshape(-1, ps * ps * c)


def test_views_and_token_layout_match_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the tile grid, every view's patches (1e-5) and the placeholder's expansion equal
    what Step3p7Processor makes of '<im_patch>' and the image."""
    profile = Core.open(tiny[1]).manifest.vision
    for data in STEP.encoded_images() + [encode(*SCALED)]:
        header = images.read_header(data, profile, "image 1")
        cost = images.cost(header.width, header.height, profile)
        processed = processor(text="<im_patch>", images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        expected = _reference_views(processed)
        assert cost.tiles[0] * cost.tiles[1] == int(processed["num_local_patches"][0]), (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == len(expected)
        for (pixels, positions), view in zip(views, expected):
            assert float((pixels - _patches(view, profile.patch_size)).abs().max()) <= 1e-5
            side = view.shape[-1] // profile.patch_size
            assert positions.tolist() == [[x, y] for y in range(side) for x in range(side)]
        ids, runs = images.token_layout(cost, profile)
        assert ids == processed["input_ids"][0].tolist()
        assert cost.num_tokens == sum(rows for _, rows in runs) == ids.count(profile.image_token_id)


_LAYER_TO_HUB = (
    ("self_attn.out_proj.", "attn.out_proj."),
    ("layernorm_before.", "ln_1."),
    ("layernorm_after.", "ln_2."),
    ("mlp.fc1.", "mlp.c_fc."),
    ("mlp.fc2.", "mlp.c_proj."),
    ("lambda_1", "ls_1.gamma"),
    ("lambda_2", "ls_2.gamma"),
)
_TO_HUB = (
    ("model.vision_model.embeddings.patch_embedding.weight", "vision_model.conv1.weight"),
    ("model.vision_model.embeddings.position_embedding.weight", "vision_model.positional_embedding"),
    ("model.vision_model.pre_layernorm.", "vision_model.ln_pre."),
    ("model.vision_model.downsampler", "vision_model.vit_downsampler"),
    ("model.multi_modal_projector.", "vit_large_projector."),
)


_QKV = re.compile(r"^model\.vision_model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")


def hub_layout(tensors: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers' vision names -> StepFun's (the inverse of transformers' step3p7 conversion):
    q/k/v fused into in_proj with q and k rows interleaved per head, as the hub checkpoints ship them."""
    rest, fused = fused_qkv(tensors, _QKV, heads)
    out = {}
    for name, t in rest.items():
        layer = re.match(r"^model\.vision_model\.layers\.(\d+)\.(.*)$", name)
        if layer:
            i, rest_of_name = layer.groups()
            for ours, theirs in _LAYER_TO_HUB:
                rest_of_name = rest_of_name.replace(ours, theirs)
            out[f"vision_model.transformer.resblocks.{i}.{rest_of_name}"] = t
            continue
        for ours, theirs in _TO_HUB:
            name = name.replace(ours, theirs) if name.startswith(ours) else name
        out[name] = t
    return out | {f"vision_model.transformer.resblocks.{i}.attn.in_proj_{kind}": t for (i, kind), t in fused.items()}


def test_stepfun_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """StepFun's own vision layout (conv1, transformer.resblocks.N with a fused, rope-interleaved
    in_proj, vit_large_projector): transformers loads it to the same model, and the core exported
    from it has the same weights as the one from transformers' names."""
    heads = json.loads((tiny[0] / "config.json").read_text())["vision_config"]["heads"]
    hub = check_hub_layout(STEP, tiny, tmp_path, lambda tensors: hub_layout(tensors, heads), lambda name: True)
    assert "vision_model.transformer.resblocks.0.attn.in_proj_weight" in hub


def test_transformers_spellings_read_the_same_vision_config(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers rewrites the tiny config in its own spellings (hidden_size, num_hidden_layers,
    intermediate_size): the same vision tower."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(tiny[0])).save_pretrained(str(tmp_path))
    native = json.loads((tmp_path / "config.json").read_text())
    assert "hidden_size" in native["vision_config"] and "width" not in native["vision_config"]
    config_from_hf = FAMILIES["step5"].config_from_hf
    ours = config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    assert ours.vision is not None and config_from_hf(native) == ours
