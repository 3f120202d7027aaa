"""Checks every vision family's tests run on its exported tiny multimodal core: the export itself, the
vision program and step programs against transformers on processed images, and the program against the
family's float64 reference tower (through its Family contract)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file

from helios.core import Core
from helios.core.program import SCORED_PREFILL, STEP, VISION, run_prompt
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import FAMILIES
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel


def export_tiny_vision(family: str, recipe: str, name: str, tmp_path_factory) -> tuple[Path, Path]:
    """(tiny multimodal checkpoint of `family`, its float32 core with prompt logprobs)."""
    checkpoint = write_testmodel(family, tmp_path_factory.mktemp("ckpt") / f"tiny-{name}", seed=3, vision=True)
    out = tmp_path_factory.mktemp("cores") / name
    export_core(
        open_source(str(checkpoint)),
        load_recipe(recipe),
        ExportOptions(out=out, prompt_logprobs=True, dtype="float32"),
    )
    return checkpoint, out


def check_features_and_logprobs(
    core_dir: Path,
    reference: Any,
    processor: Any,
    prompt: str,
    encoded: list[bytes],
    pixel_inputs: Callable[[Any], dict[str, Any]],
    chunk: int,
    tolerance: float,
) -> None:
    """Per image (one view each): the vision program's features equal transformers' get_image_features,
    and every step program, fed those features and prefilled in `chunk`-token pieces that cut through the
    image rows, gives transformers' logprobs on the processor's expansion of `prompt`."""
    core = Core.open(core_dir)
    m = core.manifest
    profile = m.vision
    weights = core.load_weights()
    vision = core.load_program(VISION)
    programs = {kind: core.load_program(kind) for kind in (STEP, SCORED_PREFILL)}
    worst_features = worst = worst_first = 0.0
    for data in encoded:
        pixels, positions = images.prepare_views(images.decode(data), profile)[0]
        ours = vision(weights, [], pixel_values=pixels, pixel_positions=positions)["image_features"]
        processed = processor(text=prompt, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        ids = processed["input_ids"][0].tolist()
        with torch.no_grad():
            theirs = reference.get_image_features(**pixel_inputs(processed)).pooler_output[0]
            logits = reference(input_ids=torch.tensor([ids]), **pixel_inputs(processed)).logits[0].float()
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
                chunk=chunk,
                image_features=ours,
                image_positions=image_positions,
            )
            worst_first = max(worst_first, float((run.logprobs[-1] - expected[-1]).abs().max()))
            worst = max(worst, float((run.logprobs - expected).abs().max()))
    assert max(worst_features, worst) <= tolerance, (worst_features, worst)
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
