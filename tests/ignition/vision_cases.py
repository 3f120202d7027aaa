"""The vision families' test table (CASES, by family name): per family its tiny multimodal checkpoint and
core (`ignition testmodel <family> --vision`, exported with the recipe), transformers' model and
processor as the oracle, the test images and prompt, and what the exported image profile declares.
Read by tests/ignition/test_vision_families.py (the checks every family shares, parametrized over the
table), the per-family vision tests (what only that family has) and tests/server/test_images_families.py.

The processors are transformers' own (resize rule, padding, rescale/normalize fusion, patch order,
temporal repeat, placeholder expansion); where torchvision is absent (the project does not depend on
it) they run on the torch stand-ins of tests/ignition/processor_standin.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.ignition.processor_standin import Mode, encode, reference_processor

Shape = tuple[int, int, str, dict[str, Any]]  # (width, height, format, PIL save options)


def grid_inputs(processed: Any) -> dict[str, Any]:
    """The processor outputs a Qwen2-VL-style ForConditionalGeneration takes for images."""
    return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}


def tiled_inputs(processed: Any) -> dict[str, Any]:
    """The processor outputs Step3p7ForConditionalGeneration takes (the global view, then any tiles)."""
    return {k: processed[k] for k in ("pixel_values", "pixel_values_local", "num_local_patches") if k in processed}


def image_features(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """One image's features from the ForConditionalGeneration's get_image_features."""
    return model.get_image_features(**inputs).pooler_output[0]


def inner_image_features(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """One image's features from the inner model's get_image_features."""
    return model.model.get_image_features(**inputs).pooler_output[0]


@dataclass(frozen=True, eq=False)  # compared (and hashed) by identity: pytest groups a module's tests by case
class VisionCase:
    family: str  # ignition.models.FAMILIES key
    recipe: str
    name: str  # the tiny core's (and checkpoint's) name
    model_class: str  # transformers' multimodal ForConditionalGeneration
    shapes: tuple[Shape, ...]  # the test images
    # The exported profile: (resize, resample, patch_size, pooling_kernel_size, temporal_patch_size),
    # max_image_tokens_per_image, max_patches, and further profile fields by name.
    rule: tuple[str, str, int, int, int]
    per_image: int
    max_patches: int
    fields: dict[str, Any] = field(default_factory=dict)
    # The tokens the profile names (as the tokenizer spells them): the image token, the placeholder the
    # template renders (None: the image token), the framing helios adds, further token fields by name.
    image_token: str = ""
    placeholder: str | None = None
    prefix: tuple[str, ...] = ()
    suffix: tuple[str, ...] = ()
    token_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)
    framing: int = 2  # tokens around each image's in the prompt (helios' or the template's)
    smallest: int = 2  # the fewest tokens of an admitted image
    step_inputs: tuple[str, ...] = ()  # step program inputs the family adds (besides the image ones)
    # The oracle: what the chat template renders for one image (fed to the processor), the processor,
    # its outputs the model takes, the model's image features, a BOS the processor leaves out, and
    # the prefill chunk that cuts through the image rows.
    framed: str = ""
    processor: Callable[[Path], AbstractContextManager[Any]] | None = None
    pixel_inputs: Callable[[Any], dict[str, Any]] = grid_inputs
    features: Callable[[Any, dict[str, Any]], torch.Tensor] = image_features
    bos: bool = False
    chunk: int = 11
    template_framing: tuple[str, ...] = ()  # the template's own tokens around the expansion (in `framed`)
    text_only: dict[str, Any] = field(default_factory=lambda: {"image_token_id": 10**6})  # reads text-only

    def __str__(self) -> str:
        return self.family

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch row: 3 channels of each frame (a still image has one)."""
        return 3 * max(1, self.rule[4]) * self.rule[2] ** 2

    @property
    def prompt(self) -> str:
        return f"Describe this picture: {self.framed} in short."

    def encoded_images(self) -> list[bytes]:
        return [encode(*shape) for shape in self.shapes]

    def reference(self, checkpoint: Path) -> Any:
        """transformers' model of the checkpoint, float32, eager attention, in eval mode."""
        import transformers

        model = getattr(transformers, self.model_class).from_pretrained(
            str(checkpoint), dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()


def _processor(model: str, name: str, image: tuple[str, str] | None = None, **options: Any):
    """transformers.models.`model`'s `name`Processor over the `name`ImageProcessor of its module (or of
    `image`: (model, name))."""
    image_model, image_name = image or (model, name)
    modules = (f"{image_model}.image_processing_{image_model}", f"{model}.processing_{model}")
    return functools.partial(reference_processor, modules, f"{name}Processor", f"{image_name}ImageProcessor", **options)


# Every family's first three images take the resize rule's main branches; the second (a 300 x 200
# JPEG) is the server tests' image.
GLM = VisionCase(
    "glm5_next",
    "glm53",
    "glm53-vision",
    "Glm5NextForConditionalGeneration",
    (
        (150, 60, "PNG", {}),  # canvas 168 x 84 (3 x 6 tokens), the image kept at its size and zero-padded
        (300, 200, "JPEG", {"quality": 90}),  # 308 x 224 is over 64 tokens: cut to 252 x 168 (6 x 9), scaled down
        (20, 15, "WEBP", {"lossless": True}),  # one token is under 4: canvas 84 x 56, scaled up to 74 x 56, padded
    ),
    ("fit_and_pad", "torch_bicubic", 14, 2, 2),
    64,
    256,
    {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28},
    image_token="<|image|>",  # the template frames each image itself: it expands to image tokens only
    smallest=4,
    step_inputs=("state_slots",),
    framed="<|begin_of_image|><|image|><|end_of_image|>",
    template_framing=("<|begin_of_image|>", "<|end_of_image|>"),
    processor=_processor("glm5_next", "Glm5Next", patch_image_processing=True),
)
KIMI = VisionCase(
    "kimi_k3",
    "kimi3",
    "kimi-k25-vision",
    "Kimi_K25ForConditionalGeneration",
    (
        (150, 60, "PNG", {}),  # 10 x 4 patches, kept: padded to 168 x 84, 6 x 3 tokens
        (300, 200, "JPEG", {"quality": 90}),  # 21 x 14 patches: scaled to 139 x 93, padded to 140 x 112, 5 x 4 tokens
        (40, 400, "WEBP", {"lossless": True}),  # 28 patches high: scaled to 22 x 224, padded to 28 x 224, 1 x 8 tokens
    ),
    ("navit", "torch_bicubic", 14, 2, 0),
    64 // 4 + 16 // 2 + 1,  # at most 64 patches and 16 a side before padding
    4 * (64 // 4 + 16 // 2 + 1),
    {"patch_budget": 64, "max_side_patches": 16, "min_pixels": 0, "max_pixels": 0},
    image_token="<|media_pad|>",
    placeholder="<|kimi_image_placeholder|>",  # K3's template; helios adds K2.5's framing
    prefix=("<|media_begin|>", "image", "<|media_content|>"),
    suffix=("<|media_end|>",),
    framing=4,
    framed="<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",  # what K2.5's template renders
    processor=_processor("kimi_k25", "Kimi_K25", patch_image_processing=True),
)
MINIMAX = VisionCase(
    "minimax_m3",
    "minimax_m3",
    "minimax-m3-vision",
    "MiniMaxM3SparseForConditionalGeneration",
    (
        (150, 60, "PNG", {}),  # sides rounded to 140 x 56, inside the bounds: 2 x 5 tokens
        (300, 200, "JPEG", {"quality": 90}),  # 308 x 196 is over max_pixels: scaled down to 252 x 168, 6 x 9 tokens
        (40, 30, "WEBP", {"lossless": True}),  # 28 x 28 is under min_pixels: scaled up to 84 x 56, 2 x 3 tokens
    ),
    ("smart_resize", "torch_bicubic", 14, 2, 2),
    64,
    256,
    {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28},
    image_token="]<]image[>[",
    prefix=("]<]start of image[>[",),
    suffix=("]<]end of image[>[",),
    smallest=4,
    framed="]<]image[>[",
    processor=_processor("minimax_m3_vl", "MiniMaxM3VL"),
)
# Muse Spark's images are all non-square (transformers' transposed position-table sampling only shows
# there) and span more than one 4 x 4-patch attention window.
MUSE = VisionCase(
    "muse_spark",
    "muse_spark",
    "muse-spark-vision",
    "MuseSparkForConditionalGeneration",
    (
        (150, 60, "PNG", {}),  # 5.4 x 2.1 tokens: 5 x 2 (140 x 56), inside the cap, 3 windows
        (300, 200, "JPEG", {"quality": 90}),  # 10.7 x 7.1 tokens is over 64: 9 x 6 (252 x 168)
        (40, 70, "WEBP", {"lossless": True}),  # 1.4 x 2.5 tokens: 2 x 3 (56 x 84), tied with 1 x 2 on aspect error
    ),
    ("aspect_grid", "lanczos", 14, 2, 2),
    64,
    256,
    {"min_pixels": 0, "max_pixels": 0, "patch_budget": 0, "image_mean": (0.5,) * 3, "image_std": (0.5,) * 3},
    image_token="<|patch|>",
    prefix=("<|image_start|>",),
    suffix=("<|image_end|>",),
    framed="<|patch|>",
    processor=_processor("muse_spark", "MuseSpark", ("muse_glimmer", "MuseGlimmer"), mode=Mode.LANCZOS),
    chunk=7,
    text_only={"text_only": True},  # the text test checkpoints' marker
)
# Step 3.7: a 168-pixel global view plus 112-pixel sliding-window tiles of at most 448 a side.
STEP = VisionCase(
    "step5",
    "step5",
    "step5-vision",
    "Step3p7ForConditionalGeneration",
    (
        (150, 60, "PNG", {}),  # fits the global view but elongated: 3 x 1 tiles of the short side
        (300, 200, "JPEG", {"quality": 90}),  # 3 x 2 tiles of 112, a <patch_newline> after the first row
        (200, 30, "WEBP", {"lossless": True}),  # extreme aspect: zero-padded to 200 x 200 first, 2 x 2 tiles
        (120, 100, "PNG", {}),  # no tiles: the global view alone
    ),
    ("global_and_tiles", "torch_bilinear", 14, 4, 0),
    4 * 4 * 4 + 9,  # 4 x 4 tiles of 448, then the global view
    144,
    {"image_size": 168, "tile_size": 112, "max_image_side": 448},
    image_token="<im_patch>",
    prefix=("<im_start>",),
    suffix=("<im_end>",),
    token_fields={
        "tile_prefix_token_ids": ("<patch_start>",),
        "tile_suffix_token_ids": ("<patch_end>",),
        "tile_row_separator_token_ids": ("<patch_newline>",),
    },
    smallest=9,  # the global view's
    framed="<im_patch>",
    processor=_processor("step3p7", "Step3p7", mode=Mode.BILINEAR),
    pixel_inputs=tiled_inputs,
    features=inner_image_features,
    bos=True,
)
# Gemma 4's reference processor takes images only (tests/ignition/test_gemma4_vision.py builds its prompts).
GEMMA = VisionCase(
    "gemma4",
    "gemma4",
    "gemma4-vision",
    "Gemma4ForConditionalGeneration",
    (),
    ("aspect_ratio_patch_budget", "bicubic", 4, 3, 0),
    70,
    630,
    image_token="<|image|>",
    prefix=("<|image>",),
    suffix=("<image|>",),
    smallest=1,
)
CASES = {case.family: case for case in (GLM, KIMI, MINIMAX, MUSE, STEP, GEMMA)}
# The families whose reference processor expands the prompt's placeholder (the rest of the checks).
PROCESSED = [case for case in CASES.values() if case.processor is not None]
