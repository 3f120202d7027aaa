"""Shared by the vision-family tests: test images, and torch stand-ins for the torchvision calls
transformers' image processors make, so a reference processor runs where torchvision is absent.

`reference_processor(...)` builds a family's reference processor on them. `import_processing(names)`
imports transformers' processing modules (names under transformers.models; with real torchvision where
it loads, else with the stand-in posing as torchvision's v2 functional API while they import) and says
which; `functional(...)` builds that stand-in from the primitives here: uint8 bicubic and bilinear
(torch's antialiased kernels, the ones torchvision calls on CPU), uint8 LANCZOS (PIL's filter), constant
padding and per-channel normalization.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import io
import json
import platform
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def encode(width: int, height: int, fmt: str, options: dict, seed: int = 0) -> bytes:
    """A test image: a horizontal gradient under noise, saved as `fmt` with PIL's `options`."""
    rng = np.random.default_rng(seed + width)
    grad = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(grad * 0.5 + rng.integers(0, 128, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return buffer.getvalue()


class Mode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def resize(image: torch.Tensor, size, interpolation=Mode.BILINEAR, antialias: bool = True) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize on uint8 images [..., 3, H, W]: bicubic by torch's
    native uint8 kernel; bilinear by it where the CPU has one (AVX2, AVX512, ARM), else in float32
    rounded back (checked bit-equal against torchvision 0.28); LANCZOS by PIL per image."""
    assert interpolation in (Mode.BICUBIC, Mode.BILINEAR, Mode.LANCZOS) and image.dtype == torch.uint8
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    flat = image.reshape(-1, *image.shape[-3:])
    if interpolation == Mode.BILINEAR:
        native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
            "aarch64",
            "arm64",
        )
        out = torch.nn.functional.interpolate(
            flat if native else flat.float(), size=list(size), mode="bilinear", align_corners=False, antialias=antialias
        )
        out = out if native else out.round().to(image.dtype)
        return out.reshape(*image.shape[:-2], *size)
    if interpolation == Mode.BICUBIC:
        out = torch.nn.functional.interpolate(
            flat, size=list(size), mode="bicubic", align_corners=False, antialias=antialias
        )
        return out.reshape(*image.shape[:-2], *size)
    out = torch.stack(
        [
            torch.from_numpy(
                np.array(Image.fromarray(x.permute(1, 2, 0).numpy()).resize((size[1], size[0]), Image.LANCZOS))
            )
            for x in flat
        ]
    )
    return out.permute(0, 3, 1, 2).reshape(*image.shape[:-2], *size)


def pad(image: torch.Tensor, padding, fill=0, padding_mode: str = "constant") -> torch.Tensor:
    """torchvision's pad with [left, top, right, bottom] constant padding."""
    assert padding_mode == "constant"
    left, top, right, bottom = padding
    return torch.nn.functional.pad(image, (left, right, top, bottom), value=fill)


def normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - mean) / std


def functional() -> types.SimpleNamespace:
    """The stand-in for torchvision.transforms.v2.functional."""
    return types.SimpleNamespace(resize=resize, pad=pad, normalize=normalize, InterpolationMode=Mode)


def import_processing(names: tuple[str, ...]) -> tuple[tuple[types.ModuleType, ...], bool]:
    """transformers.models.<name> for each name ("model_dir.module"), and whether torchvision is real
    (else they were imported with the stand-in posing as torchvision, removed again afterwards)."""
    import transformers  # noqa: F401  (its availability checks run before any stand-in exists)

    try:
        import torchvision.transforms.v2.functional  # noqa: F401

        return tuple(importlib.import_module(f"transformers.models.{n}") for n in names), True
    except Exception:  # absent, or a build whose compiled ops do not load on this torch
        pass
    stand_in = functional()
    stand_ins = {
        "torchvision": types.ModuleType("torchvision"),
        "torchvision.transforms": types.ModuleType("torchvision.transforms"),
        "torchvision.transforms.v2": types.SimpleNamespace(functional=stand_in),
        "torchvision.transforms.v2.functional": stand_in,
    }
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)  # type: ignore[arg-type]
    try:
        return tuple(importlib.import_module(f"transformers.models.{n}") for n in names), False
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def reference_processor(
    modules: tuple[str, str],
    processor: str,
    image_processor: str,
    checkpoint: Path,
    mode: Mode = Mode.BICUBIC,
    patch_image_processing: bool = False,
) -> Iterator[Any]:
    """transformers' `processor` (of modules[1], e.g. "minimax_m3_vl.processing_minimax_m3_vl") over its
    `image_processor` (of modules[0]) made with the test checkpoint's preprocessor_config.json, and the
    checkpoint's tokenizer: on torchvision where it imports, else on the stand-in above resizing by
    `mode` (also patched into the image processing module itself where it holds its own tvF reference).
    LANCZOS: the stand-in reports a torchvision new enough for transformers to pass it on (>= 0.27
    resizes uint8 LANCZOS on the CPU; it is assumed to equal PIL's filter, the one transformers'
    warning names as the original)."""
    import pytest
    import transformers.image_processing_backends as backends
    from transformers import PreTrainedTokenizerFast
    from transformers.image_utils import PILImageResampling

    (image_processing, processing), real = import_processing(modules)
    processor_class = getattr(processing, processor)
    patch = pytest.MonkeyPatch()
    if not real:
        stand_in = functional()
        patch.setattr(backends, "tvF", stand_in, raising=False)
        if patch_image_processing:
            patch.setattr(image_processing, "tvF", stand_in, raising=False)
        patch.setattr(backends, "pil_torch_interpolation_mapping", {PILImageResampling[mode.name]: mode})
        if mode == Mode.LANCZOS:
            patch.setattr(backends, "is_torchvision_greater_or_equal", lambda version: True)
        # The class check looks up BaseVideoProcessor, which transformers leaves out without torchvision.
        patch.setattr(processor_class, "check_argument_for_proper_class", lambda self, name, arg: None)
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    settings = {k: v for k, v in config.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    try:
        yield processor_class(getattr(image_processing, image_processor)(**settings), tokenizer=tokenizer)
    finally:
        patch.undo()
