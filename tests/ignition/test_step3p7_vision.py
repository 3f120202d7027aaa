"""Step 3.7 vision cores: a tiny multimodal checkpoint (2-layer vision tower over 14-pixel patches,
a 168-pixel global view plus 112-pixel sliding-window tiles, two stride-2 downsampling convs, a
projector with a bias) exported with its vision program, checked against transformers'
Step3p7ImageProcessor + Step3p7Processor (helios' profile-driven views and token layout),
Step3p7Model.get_image_features (the vision program, per view) and
Step3p7ForConditionalGeneration (logprobs with images in the prompt), on images of different
sizes and formats: no tiles, tiles in one row, tiles in rows (with <patch_newline>), an extreme
aspect squared by zero padding, and one scaled down to max_image_size. StepFun's hub vision layout
reads to the same core weights as transformers' names.

transformers' Step3p7ImageProcessor is a torchvision-backed processor. Where torchvision is not
installed (the project does not depend on it), its three tensor primitives are supplied here:
resize is torch's own antialiased bilinear interpolate, the kernel torchvision's CPU resize calls
on uint8 images (checked bit-equal against torchvision 0.28), pad and normalize are plain torch.
The tiling plan, crops, their order, the rescale/normalize fusion and the framing are
transformers' own code either way.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import platform
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from helios.core import Core
from helios.core.program import SCORED_PREFILL, STEP, VISION, run_prompt
from helios.frontend import images
from ignition.export import ExportOptions, export_core
from ignition.models import step3p7
from ignition.recipe import load_recipe
from ignition.sources import open_source
from tests.ignition.vision_checks import export_tiny_vision

TOLERANCE = 1e-3
# (width, height, format, PIL save options): what each exercises under the 168 / 112 / 448 profile.
SHAPES = (
    (150, 60, "PNG", {}),  # fits the global view but elongated: 3 x 1 tiles of the short side
    (300, 200, "JPEG", {"quality": 90}),  # 3 x 2 tiles of 112, a <patch_newline> after the first row
    (200, 30, "WEBP", {"lossless": True}),  # extreme aspect: zero-padded to 200 x 200 first, 2 x 2 tiles
    (120, 100, "PNG", {}),  # no tiles: the global view alone
)
SCALED = (500, 300, "JPEG", {"quality": 85})  # over max_image_size: scaled to 448 x 268 first, 4 x 3 tiles


def encode(width: int, height: int, fmt: str, options: dict, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed + width)
    grad = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(grad * 0.5 + rng.integers(0, 128, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def encoded_images() -> list[bytes]:
    return [encode(*shape) for shape in SHAPES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return export_tiny_vision("step5", "step5", "step5-vision", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]):
    from transformers import Step3p7ForConditionalGeneration

    model = Step3p7ForConditionalGeneration.from_pretrained(
        str(tiny[0]), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


class _Mode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _resize(image: torch.Tensor, size, interpolation=_Mode.BILINEAR, antialias: bool = True) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize's CPU path for uint8 bilinear images."""
    assert interpolation == _Mode.BILINEAR
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    x = image.reshape(-1, *image.shape[-3:])
    y = torch.nn.functional.interpolate(
        x if native else x.float(), size=list(size), mode="bilinear", align_corners=False, antialias=antialias
    )
    y = y if native else y.round().to(image.dtype)
    return y.reshape(*image.shape[:-2], *size)


def _pad(images: torch.Tensor, padding, fill=0, padding_mode="constant") -> torch.Tensor:
    left, top, right, bottom = padding
    return torch.nn.functional.pad(images, (left, right, top, bottom), value=fill)


def _normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - mean) / std


@contextlib.contextmanager
def reference_processor(checkpoint: Path) -> Iterator[Any]:
    """transformers' Step3p7Processor (image processor + the checkpoint's tokenizer), on torchvision
    where it imports, else on the torch primitives above."""
    import transformers.image_processing_backends as backends
    from transformers import PreTrainedTokenizerFast
    from transformers.image_utils import PILImageResampling
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor
    from transformers.models.step3p7.processing_step3p7 import Step3p7Processor

    patch = pytest.MonkeyPatch()
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # absent, or a build whose compiled ops do not load on this torch
        shim = types.SimpleNamespace(resize=_resize, pad=_pad, normalize=_normalize, InterpolationMode=_Mode)
        patch.setattr(backends, "tvF", shim, raising=False)
        patch.setattr(backends, "pil_torch_interpolation_mapping", {PILImageResampling.BILINEAR: _Mode.BILINEAR})
    settings = {k: v for k, v in step3p7.TESTMODEL_PROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    try:
        yield Step3p7Processor(Step3p7ImageProcessor(**settings), tokenizer)
    finally:
        patch.undo()


def pixel_inputs(processed) -> dict[str, Any]:
    """The processor outputs Step3p7ForConditionalGeneration takes."""
    return {k: processed[k] for k in ("pixel_values", "pixel_values_local", "num_local_patches") if k in processed}


@pytest.fixture(scope="module")
def processor(tiny: tuple[Path, Path]):
    with reference_processor(tiny[0]) as made:
        yield made


def _reference_views(processed) -> list[torch.Tensor]:
    """The processor's views of one image in feature order (tiles, then the global view): [3, S, S] each."""
    tiles = list(processed["pixel_values_local"]) if "pixel_values_local" in processed else []
    return tiles + [processed["pixel_values"][0]]


def _patches(view: torch.Tensor, ps: int) -> torch.Tensor:
    c, s, _ = view.shape
    return view.permute(1, 2, 0).reshape(s // ps, ps, s // ps, ps, c).permute(0, 2, 1, 3, 4).reshape(-1, ps * ps * c)


def test_export_declares_the_vision_profile(tiny: tuple[Path, Path]) -> None:
    m = Core.open(tiny[1]).manifest
    assert m.capabilities.vision and VISION in m.programs and m.vision is not None
    v = m.vision
    assert (v.resize, v.resample, v.patch_size, v.pooling_kernel_size) == ("global_and_tiles", "torch_bilinear", 14, 4)
    assert (v.image_size, v.tile_size, v.max_image_side, v.max_patches) == (168, 112, 448, 144)
    assert v.max_image_tokens_per_image == v.image_feature_window_tokens == 4 * 4 * 4 + 9  # 4 x 4 tiles of 448
    tok = Core.open(tiny[1]).tokenizer()
    assert v.placeholder_token_id == v.image_token_id == tok.token_to_id("<im_patch>")
    assert (v.prefix_token_ids, v.suffix_token_ids) == (
        (tok.token_to_id("<im_start>"),),
        (tok.token_to_id("<im_end>"),),
    )
    assert v.tile_row_separator_token_ids == (tok.token_to_id("<patch_newline>"),)
    assert [t.name for t in m.programs[STEP].inputs][-2:] == ["image_features", "image_rows"]
    assert m.golden.max_abs_diff <= TOLERANCE


def test_views_and_token_layout_match_the_reference_processor(tiny: tuple[Path, Path], processor) -> None:
    """Per image: the tile grid, every view's patches (1e-5) and the placeholder's expansion equal
    what Step3p7Processor makes of '<im_patch>' and the image."""
    profile = Core.open(tiny[1]).manifest.vision
    for data in encoded_images() + [encode(*SCALED)]:
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


def test_features_and_first_logprobs_match_transformers(tiny: tuple[Path, Path], reference, processor) -> None:
    core = Core.open(tiny[1])
    m = core.manifest
    profile = m.vision
    weights = core.load_weights()
    vision = core.load_program(VISION)
    core.tokenizer()
    programs = {kind: core.load_program(kind) for kind in (STEP, SCORED_PREFILL)}
    worst_features = worst = 0.0
    for data in encoded_images():
        views = images.prepare_views(images.decode(data), profile)
        ours = torch.cat([vision(weights, [], pixel_values=p, pixel_positions=q)["image_features"] for p, q in views])
        # A prompt around the image, expanded by transformers' processor.
        text = "Describe this picture: <im_patch> in short."
        processed = processor(text=text, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        with torch.no_grad():
            theirs = reference.model.get_image_features(**pixel_inputs(processed)).pooler_output[0]
            ids = [m.tokenizer.bos_token_id] + processed["input_ids"][0].tolist()
            logits = reference(input_ids=torch.tensor([ids]), **pixel_inputs(processed)).logits[0].float()
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
                chunk=11,
                image_features=ours,
                image_positions=image_positions,
            )
            worst = max(worst, float((run.logprobs[-1] - expected[-1]).abs().max()))
            worst = max(worst, float((run.logprobs - expected).abs().max()))
    assert max(worst_features, worst) <= TOLERANCE, (worst_features, worst)
    print(f"max |delta| vs transformers: features {worst_features:.3g}, logprobs {worst:.3g}")


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


def hub_layout(tensors: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers' vision names -> StepFun's (the inverse of transformers' step3p7 conversion):
    q/k/v fused into in_proj with q and k rows interleaved per head, as the hub checkpoints ship them."""
    import re

    def interleave(w: torch.Tensor) -> torch.Tensor:
        half = w.shape[0] // heads // 2
        return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    out, fused = {}, {}
    for name, t in tensors.items():
        layer = re.match(r"^model\.vision_model\.layers\.(\d+)\.(.*)$", name)
        if layer:
            i, rest = layer.groups()
            qkv = re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest)
            if qkv:
                fused.setdefault((i, qkv.group(2)), {})[qkv.group(1)] = interleave(t) if qkv.group(1) != "v" else t
                continue
            for ours, theirs in _LAYER_TO_HUB:
                rest = rest.replace(ours, theirs)
            out[f"vision_model.transformer.resblocks.{i}.{rest}"] = t
            continue
        for ours, theirs in _TO_HUB:
            name = name.replace(ours, theirs) if name.startswith(ours) else name
        out[name] = t
    for (i, kind), parts in fused.items():
        out[f"vision_model.transformer.resblocks.{i}.attn.in_proj_{kind}"] = torch.cat([parts[x] for x in "qkv"])
    return out


def test_stepfun_hub_vision_layout_reads_the_same_weights(tiny: tuple[Path, Path], reference, tmp_path: Path) -> None:
    """StepFun's own vision layout (conv1, transformer.resblocks.N with a fused, rope-interleaved
    in_proj, vit_large_projector): transformers loads it to the same model, and the core exported
    from it has the same weights as the one from transformers' names."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Step3p7ForConditionalGeneration

    source = tmp_path / "hub"
    shutil.copytree(tiny[0], source)
    heads = json.loads((tiny[0] / "config.json").read_text())["vision_config"]["heads"]
    tensors = hub_layout(load_file(str(tiny[0] / "model.safetensors")), heads)
    assert "vision_model.transformer.resblocks.0.attn.in_proj_weight" in tensors
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    loaded = Step3p7ForConditionalGeneration.from_pretrained(str(source), dtype=torch.float32).state_dict()
    expected = reference.state_dict()
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)
    out = tmp_path / "core"
    export_core(open_source(str(source)), load_recipe("step5"), ExportOptions(out=out, dtype="float32"))
    ours, theirs = Core.open(out).load_weights(), Core.open(tiny[1]).load_weights()
    assert ours.keys() == theirs.keys() and any(n.startswith("vision.") for n in ours)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_transformers_spellings_read_the_same_vision_config(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers rewrites the tiny config in its own spellings (hidden_size, num_hidden_layers,
    intermediate_size): the same vision tower."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(tiny[0])).save_pretrained(str(tmp_path))
    native = json.loads((tmp_path / "config.json").read_text())
    assert "hidden_size" in native["vision_config"] and "width" not in native["vision_config"]
    ours = step3p7.config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    assert ours.vision is not None and step3p7.config_from_hf(native) == ours
