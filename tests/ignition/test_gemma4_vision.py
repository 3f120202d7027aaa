"""Gemma 4 vision cores (tests/ignition/vision_cases.py GEMMA; the export's profile and the reference tower
are checked in test_vision_families.py): a tiny multimodal checkpoint (2-layer vision tower, 3 x 3
pooling, standardized features) checked against transformers' Gemma4ImageProcessorPil (helios'
profile-driven preparation), Gemma4Model.get_image_features (the vision program) and
Gemma4ForConditionalGeneration (logprobs with images in the prompt, also with bidirectional image
attention), on three images of different sizes and formats."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from helios.core import Core
from helios.core.program import SCORED_PREFILL, STEP, VISION, run_prompt
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import FAMILIES
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition.vision_cases import GEMMA
from tests.ignition.vision_checks import TOLERANCE, case_fixture, reference, tiny  # noqa: F401  (module fixtures over `case`)


def encoded_images() -> list[bytes]:
    """PNG 37x53, JPEG 64x40, WebP 90x90 (lossless), seeded noise over gradients."""
    rng = np.random.default_rng(0)
    out = []
    for (w, h), fmt, extra in (
        ((37, 53), "PNG", {}),
        ((64, 40), "JPEG", {"quality": 90}),
        ((90, 90), "WEBP", {"lossless": True}),
    ):
        grad = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
        pixels = np.clip(grad * 0.5 + rng.integers(0, 128, (h, w, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format=fmt, **extra)
        out.append(buffer.getvalue())
    return out


case = case_fixture(GEMMA)


def _processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    assert FAMILIES["gemma4"].tiny.vision is not None
    settings = {k: v for k, v in FAMILIES["gemma4"].tiny.vision.processor.items() if k != "image_processor_type"}
    return Gemma4ImageProcessorPil(**settings)


def _prompt(core: Core, image_tokens: int) -> tuple[list[int], list[int]]:
    """The ids of a prompt around one framed image of `image_tokens` tokens, and the image rows."""
    m, profile, tok = core.manifest, core.manifest.vision, core.tokenizer()
    ids = (
        [m.tokenizer.bos_token_id]
        + tok.encode("Describe this picture:", add_special_tokens=False).ids
        + list(profile.prefix_token_ids)
        + [profile.image_token_id] * image_tokens
        + list(profile.suffix_token_ids)
        + tok.encode(" in short.", add_special_tokens=False).ids
    )
    return ids, [i for i, t in enumerate(ids) if t == profile.image_token_id]


def _logprobs(reference, ids: list[int], processed, **inputs) -> torch.Tensor:
    """Gemma4ForConditionalGeneration's logprobs at every position of `ids` with the processed image."""
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor([ids]),
            pixel_values=processed["pixel_values"],
            image_position_ids=processed["image_position_ids"],
            **inputs,
        )
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _worst(core: Core, weights, ids: list[int], image_positions: list[int], features, expected) -> float:
    """The largest |delta| of the step programs' logprobs (11-token chunks) from `expected`."""
    m, worst = core.manifest, 0.0
    for kind in (STEP, SCORED_PREFILL):
        run = run_prompt(
            core.load_program(kind),
            weights,
            m.kv,
            m.limits.page_tokens,
            ids,
            chunk=11,
            image_features=features,
            image_positions=image_positions,
        )
        worst = max(worst, float((run.logprobs - expected).abs().max()))
    return worst


def test_preparation_matches_the_reference_processor(tiny: tuple[Path, Path]) -> None:
    profile = Core.open(tiny[1]).manifest.vision
    processor = _processor()
    for data in encoded_images():
        header = images.read_header(data, profile, "image 1")
        ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        pixels, positions = images.prepare(images.decode(data), profile)
        n = pixels.shape[0]
        assert images.cost(header.width, header.height, profile).num_tokens == int(ref["num_soft_tokens_per_image"][0])
        assert torch.equal(positions, ref["image_position_ids"][0, :n])
        assert float((pixels - ref["pixel_values"][0, :n]).abs().max()) <= 1e-6
        assert bool((ref["image_position_ids"][0, n:] == -1).all())


def test_features_and_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    core = Core.open(tiny[1])
    profile, weights, vision = core.manifest.vision, core.load_weights(), core.load_program(VISION)
    processor = _processor()
    worst = 0.0
    for data in encoded_images():
        pixels, positions = images.prepare(images.decode(data), profile)
        ours = vision(weights, [], pixel_values=pixels, pixel_positions=positions)["image_features"]
        ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        with torch.no_grad():
            theirs = reference.model.get_image_features(ref["pixel_values"], ref["image_position_ids"]).pooler_output[0]
        worst = max(worst, float((ours - theirs).abs().max()))
        # A prompt around the image: the step with these features vs the full multimodal model.
        ids, image_positions = _prompt(core, len(ours))
        worst = max(worst, _worst(core, weights, ids, image_positions, ours, _logprobs(reference, ids, ref)))
    assert worst <= TOLERANCE, worst
    print(f"max |delta| vs transformers: {worst:.3g}")


def test_bidirectional_image_attention_matches_transformers(tmp_path: Path) -> None:
    """use_bidirectional_attention "vision": on sliding layers an image's tokens also see its later
    tokens. run_prompt (11-token chunks, which it never lets end inside an image) and the engine
    (prefill chunks of 11, moved off the image the same way, then decoding) match
    Gemma4ForConditionalGeneration given mm_token_type_ids; the causal model does not."""
    from transformers import Gemma4ForConditionalGeneration

    from helios.engine import EngineConfig, build_engine
    from helios.engine.offline import run_to_completion
    from helios.engine.request import EngineImage, EngineRequest
    from helios.engine.sampling_params import SamplingParams

    checkpoint = write_testmodel(
        "gemma4", tmp_path / "ckpt", seed=3, vision=True, overrides={"use_bidirectional_attention": "vision"}
    )
    out = tmp_path / "core"
    export_core(
        open_source(str(checkpoint)),
        load_recipe("gemma4"),
        ExportOptions(out=out, prompt_logprobs=True, dtype="float32"),
    )
    core = Core.open(out)
    profile, weights = core.manifest.vision, core.load_weights()
    assert "attention_until" in core.load_program(STEP).input_names
    reference = Gemma4ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    data = encoded_images()[2]
    pixels, positions = images.prepare(images.decode(data), profile)
    features = core.load_program(VISION)(weights, [], pixel_values=pixels, pixel_positions=positions)["image_features"]
    ref = _processor()(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    ids, image_positions = _prompt(core, len(features))
    types = torch.tensor([[int(t == profile.image_token_id) for t in ids]])
    expected = _logprobs(reference, ids, ref, mm_token_type_ids=types)
    assert float((_logprobs(reference, ids, ref) - expected).abs().max()) > 10 * TOLERANCE  # the mask matters
    assert _worst(core, weights, ids, image_positions, features, expected) <= TOLERANCE
    image = EngineImage(
        start=image_positions[0],
        num_tokens=len(image_positions),
        digest=b"bidirectional",
        prepare=lambda: images.prepare_views(images.decode(data), profile),
    )
    greedy = SamplingParams(1.0, 1.0, 1, 0.0, 1.0, 0.0, 0.0, 0)
    request = EngineRequest("r", tuple(ids), (greedy,), 1, ignore_eos=True, num_top_logprobs=5, images=(image,))
    engine = build_engine(core, EngineConfig(num_pages=32, prefill_chunk_size=11))
    first = run_to_completion(engine, [request])["r"][0].logprobs[0]
    assert abs(first.logprob - float(expected[-1].max())) <= TOLERANCE
    assert [t for t, _ in first.alternatives] == expected[-1].topk(5).indices.tolist()
