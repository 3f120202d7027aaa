"""The export hooks of a family with a vision tower module (ignition.models.family.Vision), bound once.

Tower modules (minimax_m3_vision, kimi_k25_vision, glm5_next_vision, muse_spark_vision, step3p7_vision,
gemma4_vision; their shared building blocks in vision_common) share one interface: VisionProgram(v),
example_inputs(v), reference_features(v, hf, pixels, positions) and profile(v, processor,
max_model_len, token_id), each on the config's `vision`; a family binds it with
`vision=vision_hooks.of(module)` and `Reference(..., features=vision_hooks.reference_features(module))`;
hf_shapes(v), the tower's test-checkpoint tensors, joins the text model's in `nested_shapes`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ignition.models.family import Vision
from ignition.models.naming import nested

Shapes = dict[str, tuple[int, ...]]  # Hugging Face tensor name -> shape


def of(tower: ModuleType, bidirectional: Callable[[Any], bool] | None = None) -> Vision:
    """The tower's hooks; `bidirectional` (Vision.bidirectional): whether a config's image tokens attend both ways."""

    def vision_program(config: Any) -> torch.nn.Module:
        assert config.vision is not None
        return tower.VisionProgram(config.vision)

    def vision_examples(config: Any) -> tuple[Tensor, Tensor]:
        assert config.vision is not None
        return tower.example_inputs(config.vision)

    def vision_profile(config: Any, processor: dict[str, Any], max_model_len: int, token_id=None):
        assert config.vision is not None
        return tower.profile(config.vision, processor, max_model_len, token_id or (lambda text: None))

    return Vision(program=vision_program, examples=vision_examples, profile=vision_profile, bidirectional=bidirectional)


def reference_features(tower: ModuleType) -> Callable[[Any, dict[str, Tensor], Tensor, Tensor], Tensor]:
    def features(config: Any, hf_weights: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
        assert config.vision is not None
        return tower.reference_features(config.vision, hf_weights, pixels, positions)

    return features


def nested_shapes(text_shapes: Callable[[Any], Shapes], tower: ModuleType) -> Callable[[Any], Shapes]:
    """The hf_shapes hook (TinyCheckpoint.hf_shapes) of a family whose multimodal checkpoints nest the
    text model under model.language_model. (a ForConditionalGeneration's layout): a config's
    `text_shapes`, as they are without a vision tower, else nested and followed by the tower's."""

    def hf_shapes(config: Any) -> Shapes:
        text = text_shapes(config)
        if config.vision is None:
            return text
        return nested(text) | tower.hf_shapes(config.vision)

    return hf_shapes


def image_tokens(tower: ModuleType) -> tuple[str, str, str]:
    """The tower's image placeholder token and the two framing each image (IMAGE_TOKEN, START_TOKEN,
    END_TOKEN), as a test checkpoint's chat flavour must carry them."""
    return tower.IMAGE_TOKEN, tower.START_TOKEN, tower.END_TOKEN
