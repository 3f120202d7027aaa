"""Token limits at the served context: the output limit each engine request gets (the one place a
request's max_tokens is resolved), and the context-derived image limits /v1/models advertises.
"""

from __future__ import annotations

from dataclasses import dataclass

from helios.config import ServerConfig
from helios.core.manifest import Manifest, VisionProfile
from helios.frontend.inference import InferenceRequest, RawPrompt, RequestError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # tokens in the served context: prompt plus output
    default_max_tokens: int  # the output budget of a request that omits one; <= max_model_len
    max_images_per_prompt: int  # 0 for a text-only core
    max_image_tokens_per_prompt: int  # image feature tokens across a conversation; 0 for a text-only core

    @classmethod
    def of(cls, manifest: Manifest, config: ServerConfig, vision: VisionProfile | None) -> RequestLimits:
        context = manifest.limits.max_model_len
        configured = config.default_max_tokens  # [server] default_max_tokens, else the whole context
        framing = len(vision.prefix_token_ids) + len(vision.suffix_token_ids) if vision else 0
        # Context-derived image limits at the served context (spec /v1/models), within the core's own.
        return cls(
            max_model_len=context,
            default_max_tokens=context if configured is None else min(configured, context),
            max_images_per_prompt=(
                min(vision.max_images_per_prompt, max(0, (context - 1) // (1 + framing))) if vision else 0
            ),
            max_image_tokens_per_prompt=(
                min(vision.max_image_tokens_per_prompt, max(0, context - 1 - framing)) if vision else 0
            ),
        )

    def output_limit(self, request: InferenceRequest, prompt_len: int) -> int:
        """The output limit the engine gets for one prompt: the request's max_tokens (or the
        default), bounded by the context the prompt leaves, so reaching it reports the limit cause.
        0 stays 0 (tokenize, echo or score only). Only a prompt that leaves no room for one output
        token is refused."""
        if request.max_tokens == 0:
            return 0
        remaining = self.max_model_len - prompt_len
        if remaining < 1:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) leaves no room for output in the context of "
                f"{self.max_model_len} tokens",
                "prompt" if isinstance(request.input, RawPrompt) else "messages",
            )
        asked = self.default_max_tokens if request.max_tokens is None else request.max_tokens
        return min(asked, remaining)

    def image_limits(self, vision: VisionProfile | None) -> dict[str, int]:
        """The /v1/models image fields (none for a text-only core)."""
        if vision is None:
            return {}
        return {
            "max_images_per_prompt": self.max_images_per_prompt,
            "max_image_tokens_per_prompt": self.max_image_tokens_per_prompt,
            "image_feature_window_tokens": vision.image_feature_window_tokens,
            "max_image_tokens_per_image": min(vision.max_image_tokens_per_image, vision.image_feature_window_tokens),
            "max_image_pixels": vision.max_image_pixels,
            "max_image_bytes": vision.max_image_bytes,
        }
