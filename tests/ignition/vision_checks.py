"""Checks every vision family's tests run on its exported tiny multimodal core (tests/ignition/vision_cases.py
names the families): the export itself and its image profile, helios' preparation against transformers'
processor, the vision program and step programs against transformers on processed images, the program
against the family's float64 reference tower (through its Family contract), text-only readings, and the
vendor's own hub layout; plus the module fixtures (tiny, reference, processor) over a test module's
`case` fixture, and what the resize-rule tests share (SIZES, tiny_profile(), prefix_digest())."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from support import TinyCores

from helios.core import Core
from helios.core import manifest as mf
from helios.core.program import SCORED_PREFILL, STEP, VISION, run_prompt
from helios.frontend import images
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core
from ignition.models import FAMILIES
from ignition.models.patch_grid import block_order
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition.vision_cases import VisionCase

TOLERANCE = 1e-3
# Image sizes the resize-rule tests compare helios' rule over (inside the bounds, over and under them,
# sides under one patch, extreme aspect ratios).
SIZES = [(w, h) for w in (1, 13, 14, 27, 40, 150, 300, 333, 1000, 2048) for h in (1, 15, 28, 60, 200, 719, 4000)]


def tiny_vision(tiny_cores: TinyCores, case: VisionCase) -> tuple[Path, Path]:
    """(tiny multimodal checkpoint of the case's family, its float32 core with prompt logprobs), built once
    per test run (conftest.py's tiny_cores): the vision tests and the server's image tests share it."""
    return tiny_cores(case.family, case.recipe, 3, vision=True, prompt_logprobs=True, dtype="float32")


@pytest.fixture(scope="module")
def tiny(case: VisionCase, tiny_cores: TinyCores) -> tuple[Path, Path]:
    return tiny_vision(tiny_cores, case)


@pytest.fixture(scope="module")
def reference(case: VisionCase, tiny: tuple[Path, Path]) -> Any:
    return case.reference(tiny[0])


@pytest.fixture(scope="module")
def processor(case: VisionCase, tiny: tuple[Path, Path]) -> Any:
    assert case.processor is not None
    with case.processor(tiny[0]) as made:
        yield made


def check_export_profile(case: VisionCase, core_dir: Path) -> None:
    """The core declares vision, its program and the case's image profile; the step takes the image
    inputs; the self-check passed; the decode weights leave the tower out."""
    core = Core.open(core_dir)
    m, tok = core.manifest, core.tokenizer()
    assert m.capabilities.vision and VISION in m.programs and m.vision is not None
    v = m.vision
    assert (v.resize, v.resample, v.patch_size, v.pooling_kernel_size, v.temporal_patch_size) == case.rule
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == case.per_image
    assert v.max_patches == case.max_patches
    assert {name: getattr(v, name) for name in case.fields} == case.fields
    assert v.max_image_tokens_per_prompt == m.limits.max_model_len - 1 - case.framing
    assert v.max_images_per_prompt == (m.limits.max_model_len - 1) // (case.smallest + case.framing)
    assert v.image_token_id == tok.token_to_id(case.image_token)
    assert v.placeholder_token_id == tok.token_to_id(case.placeholder or case.image_token)
    assert v.prefix_token_ids == tuple(tok.token_to_id(t) for t in case.prefix)
    assert v.suffix_token_ids == tuple(tok.token_to_id(t) for t in case.suffix)
    for name, texts in case.token_fields.items():
        assert getattr(v, name) == tuple(tok.token_to_id(t) for t in texts), name
    assert m.programs[VISION].inputs[0].shape == ("X", case.patch_dim)
    names = [t.name for t in m.programs[STEP].inputs]
    assert set(case.step_inputs) <= set(names) and names[-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE
    text_bytes = sum(t.numel() * 4 for n, t in core.load_weights().items() if not n.startswith("vision."))
    assert m.decode_weight_bytes < text_bytes


def reference_layout(
    case: VisionCase, processed: Any, positions: torch.Tensor, rows: int, cols: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """The processor's patch rows in helios' row order, and the positions helios' rows must have.
    glm5_next, minimax_m3: transformers lays patches out in merge blocks, as helios does, at the
    positions of its get_vision_position_ids; kimi_k3: row-major; muse_spark: row-major with each
    patch's pixels frame-major (helios' are channel-major)."""
    from transformers.vision_utils import get_vision_position_ids

    theirs = processed["pixel_values"]
    if case.family in ("glm5_next", "minimax_m3"):
        thw = get_vision_position_ids(processed["image_grid_thw"], 2, include_temporal=True)  # (frame, y, x)
        assert thw[:, 0].eq(0).all()
        return theirs, thw[:, [2, 1]].tolist()
    raster = theirs.reshape(rows * cols, -1)[positions[:, 1] * cols + positions[:, 0]]
    if case.family == "muse_spark":
        raster = raster.view(len(raster), 2, 3, -1).transpose(1, 2).reshape(len(raster), -1)
    return raster, block_order(rows, cols, 2).tolist()


def check_preparation(case: VisionCase, core_dir: Path, processor: Any) -> None:
    """Per image: the format and size read from its header, the grid, every patch row (pixel values,
    1e-5) at its position, the token count and the placeholder's expansion equal what the processor
    makes of the case's framed placeholder and the image (between the template's own framing)."""
    core = Core.open(core_dir)
    profile, tok = core.manifest.vision, core.tokenizer()
    assert profile is not None
    before, after = ([tok.token_to_id(t)] for t in case.template_framing) if case.template_framing else ([], [])
    ps, k = case.rule[2], case.rule[3]
    for data, (width, height, fmt, _) in zip(case.encoded_images(), case.shapes):
        header = images.read_header(data, profile, "image 1")
        assert (header.format, header.width, header.height) == (fmt, width, height)
        cost = images.cost(header.width, header.height, profile)
        processed = processor(text=case.framed, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        rows, cols = cost.height // ps, cost.width // ps
        assert processed["image_grid_thw"].tolist() == [[1, rows, cols]], (header, cost)
        views = images.prepare_views(images.decode(data), profile)
        assert len(views) == 1
        pixels, positions = views[0]
        theirs, expected_positions = reference_layout(case, processed, positions, rows, cols)
        assert pixels.shape == theirs.shape == (cost.num_patches, case.patch_dim)
        assert float((pixels - theirs).abs().max()) <= 1e-5
        assert positions.tolist() == expected_positions
        ids, runs = images.token_layout(cost, profile)
        assert [*before, *ids, *after] == processed["input_ids"][0].tolist()
        assert (
            cost.num_tokens == cost.num_patches // k**2 == sum(n for _, n in runs) == ids.count(profile.image_token_id)
        )


def check_features_and_logprobs(case: VisionCase, core_dir: Path, reference: Any, processor: Any) -> None:
    """Per image: the vision program's features (its views in order) equal transformers' image features,
    and every step program, fed those features and prefilled in the case's chunks that cut through the
    image rows, gives transformers' logprobs on the processor's expansion of the case's prompt."""
    core = Core.open(core_dir)
    m = core.manifest
    profile = m.vision
    weights = core.load_weights()
    vision = core.load_program(VISION)
    programs = {kind: core.load_program(kind) for kind in (STEP, SCORED_PREFILL)}
    worst_features = worst = worst_first = 0.0
    for data in case.encoded_images():
        views = images.prepare_views(images.decode(data), profile)
        ours = torch.cat([vision(weights, [], pixel_values=p, pixel_positions=q)["image_features"] for p, q in views])
        processed = processor(text=case.prompt, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        ids = [m.tokenizer.bos_token_id] * case.bos + processed["input_ids"][0].tolist()
        with torch.no_grad():
            theirs = case.features(reference, case.pixel_inputs(processed))
            logits = reference(input_ids=torch.tensor([ids]), **case.pixel_inputs(processed)).logits[0].float()
        assert ours.shape == theirs.shape
        worst_features = max(worst_features, float((ours - theirs).abs().max()))
        expected = torch.log_softmax(logits, dim=-1)
        image_positions = [i for i, t in enumerate(ids) if t == profile.image_token_id]
        assert len(image_positions) == len(ours)
        for program in programs.values():
            run = run_prompt(
                program,
                weights,
                m.kv,
                m.limits.page_tokens,
                ids,
                chunk=case.chunk,
                image_features=ours,
                image_positions=image_positions,
            )
            worst_first = max(worst_first, float((run.logprobs[-1] - expected[-1]).abs().max()))
            worst = max(worst, float((run.logprobs - expected).abs().max()))
    assert max(worst_features, worst) <= TOLERANCE, (worst_features, worst)
    print(
        f"max |delta| vs transformers: features {worst_features:.3g}, first generated logprobs {worst_first:.3g}, "
        f"all prompt positions {worst:.3g}"
    )


def check_reference_tower(
    family: str, tiny: tuple[Path, Path], views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
) -> None:
    """The exported vision program and the family's float64 reference tower (Family.reference.features)
    agree on the export's example view (the self-check's input) and on `views`: one row per token."""
    fam = FAMILIES[family]
    assert fam.vision is not None and fam.reference.features is not None
    config = fam.config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    vision = fam.vision_of(config)
    assert vision is not None
    hf = load_file(str(tiny[0] / "model.safetensors"))
    core = Core.open(tiny[1])
    program, weights = core.load_program(VISION), core.load_weights()
    for pixels, positions in (fam.vision.examples(config), *views):
        got = program(weights, [], pixel_values=pixels, pixel_positions=positions)["image_features"]
        expected = fam.reference.features(config, hf, pixels, positions)
        assert got.shape == (len(pixels) // vision.pooling_kernel_size**2, vision.text_hidden_size)
        assert float((got - expected).abs().max()) <= 1e-4


def text_only_copy(case: VisionCase, checkpoint: Path, out: Path) -> dict[str, Any]:
    """The checkpoint copied to `out` with the case's text-only marker in its config (returned)."""
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text()) | case.text_only
    (out / "config.json").write_text(json.dumps(config))
    return config


def check_text_only_refuses_vision_tensors(case: VisionCase, checkpoint: Path, tmp_path: Path) -> None:
    """A text-only reading of the config has no tower, and export refuses the tower's tensors."""
    config = text_only_copy(case, checkpoint, tmp_path / "text")
    assert FAMILIES[case.family].config_from_hf(config).vision is None
    with pytest.raises(SourceError, match="vision tensors in a checkpoint whose config is not multimodal"):
        export_core(open_source(str(tmp_path / "text")), load_recipe(case.recipe), ExportOptions(out=tmp_path / "core"))


def case_fixture(case: VisionCase) -> Any:
    """A test module's `case` fixture: the family its tests (and the module fixtures above) are about."""

    @pytest.fixture(scope="module", name="case")
    def fixture() -> VisionCase:
        return case

    return fixture


def fused_qkv(
    tensors: dict[str, torch.Tensor], pattern: re.Pattern[str], heads: int
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor]]:
    """(the tensors but the q, k, v projections named by `pattern` (groups: layer, q|k|v, weight|bias);
    those fused per (layer, kind) as the vendors ship them, q and k rows back in interleaved rotary
    pairs per head: the inverse of transformers' PermuteForRope)."""
    rest: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        match = pattern.match(name)
        if match is None:
            rest[name] = t
            continue
        layer, part, kind = match.groups()
        if part != "v":
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
        parts.setdefault((layer, kind), {})[part] = t
    return rest, {key: torch.cat([p["q"], p["k"], p["v"]]) for key, p in parts.items()}


def check_hub_layout(
    case: VisionCase,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    to_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    loaded_names: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The tiny checkpoint's tensors rewritten in the vendor's own layout by `to_hub` export to the same
    core weights as transformers' names; with `loaded_names`, transformers also loads the hub layout to
    the tiny checkpoint's tensors of those names. Returns the hub layout's tensors."""
    source = tmp_path / "hub"
    shutil.copytree(tiny[0], source)
    hub = to_hub(load_file(str(tiny[0] / "model.safetensors")))
    save_file(hub, str(source / "model.safetensors"), metadata={"format": "pt"})
    if loaded_names is not None:
        import transformers

        model_class = getattr(transformers, case.model_class)
        loaded = model_class.from_pretrained(str(source), dtype=torch.float32).state_dict()
        expected = model_class.from_pretrained(str(tiny[0]), dtype=torch.float32).state_dict()
        names = [n for n in expected if loaded_names(n)]
        assert names and all(torch.equal(loaded[n], expected[n]) for n in names)
    out = tmp_path / "core"
    export_core(open_source(str(source)), load_recipe(case.recipe), ExportOptions(out=out, dtype="float32"))
    ours, theirs = Core.open(out).load_weights(), Core.open(tiny[1]).load_weights()
    assert ours.keys() == theirs.keys() and any(n.startswith("vision.layers.1.") for n in ours)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    return hub


def tiny_profile(resize: str, **fields: Any) -> mf.VisionProfile:
    """A tiny image profile under `resize` (14-pixel patches, 2 x 2 merging, 64 tokens an image) for the
    resize-rule tests; `fields`: the rule's own (and any overrides)."""
    settings: dict[str, Any] = {
        "patch_size": 14,
        "pooling_kernel_size": 2,
        "max_patches": 256,
        "resample": "torch_bicubic",
        "rescale_factor": 1 / 255,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "placeholder_token_id": 6,
        "image_token_id": 6,
        "prefix_token_ids": (8,),
        "suffix_token_ids": (9,),
        "feature_dim": 64,
        "max_images_per_prompt": 10,
        "max_image_tokens_per_prompt": 100,
        "image_feature_window_tokens": 64,
        "max_image_tokens_per_image": 64,
        "max_image_pixels": 10**8,
        "max_image_bytes": 1 << 20,
    }
    return mf.VisionProfile(resize=resize, **(settings | fields))


def prefix_digest(profile: mf.VisionProfile) -> bytes:
    """The settings digest of a profile written before the newer resize rules: its first eight fields'."""
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
    return hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()


def check_older_profiles_read_unchanged(
    profile: mf.VisionProfile, new_fields: tuple[str, ...], change: dict[str, Any]
) -> None:
    """A profile written before the rule's `new_fields` decodes with them zero, and the digests of the
    other rules are what they were (the new fields join the digest only under the rule: `change`, a
    change of them, changes the rule's digest)."""
    import msgspec

    raw = msgspec.json.decode(msgspec.json.encode(profile))
    older = {k: v for k, v in raw.items() if k not in new_fields}
    older |= {"resize": "aspect_ratio_patch_budget", "resample": "bicubic"}
    read = msgspec.json.decode(msgspec.json.encode(older), type=mf.VisionProfile)
    assert [getattr(read, name) for name in new_fields] == [0] * len(new_fields)
    assert read.settings_digest() == prefix_digest(read)
    assert profile.settings_digest() != msgspec.structs.replace(profile, **change).settings_digest()
