"""The four export hooks a family with a vision tower module provides (ignition.export): its program,
example inputs, float64 reference features and image profile, each on the config's `vision`.

Tower modules (minimax_m3_vision, kimi_k25_vision, glm5_next_vision, muse_spark_vision) share one
interface: VisionProgram(v), example_inputs(v), reference_features(v, hf, pixels, positions) and
profile(v, processor, max_model_len, token_id); a family binds it with
`vision_program, vision_examples, reference_features, vision_profile = vision_hooks.of(module)`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor


def of(tower: ModuleType) -> tuple[Callable[..., Any], ...]:
    def vision_program(config: Any) -> torch.nn.Module:
        assert config.vision is not None
        return tower.VisionProgram(config.vision)

    def vision_examples(config: Any) -> tuple[Tensor, Tensor]:
        assert config.vision is not None
        return tower.example_inputs(config.vision)

    def reference_features(config: Any, hf_weights: dict[str, Tensor], pixels: Tensor, positions: Tensor) -> Tensor:
        assert config.vision is not None
        return tower.reference_features(config.vision, hf_weights, pixels, positions)

    def vision_profile(config: Any, processor: dict[str, Any], max_model_len: int, token_id=None):
        assert config.vision is not None
        return tower.profile(config.vision, processor, max_model_len, token_id or (lambda text: None))

    return vision_program, vision_examples, reference_features, vision_profile
