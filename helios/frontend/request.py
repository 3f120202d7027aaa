"""The frontend's face: the loaded core's services (tokenizer, chat template or native encoder,
grammars, vision profile, limits) and the one call a route makes, `prepare`.

The work itself lives by responsibility: checks.py (shared option checks), prompt.py (template
lowering) and prompt_images.py (images), limits.py (output and image limits), sampling.py
(sampling ranges), prepare.py (the Prepared value, in one call on the frontend pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from helios.config import ServerConfig
from helios.core import Core
from helios.core.template import ChatTemplate
from helios.frontend import prompt as lowering
from helios.frontend.bounds import InputBounds, longest_token_chars
from helios.frontend.checkpoints import Rendering
from helios.frontend.checks import check_options
from helios.frontend.grammar import GrammarService
from helios.frontend.grammar_probe import ProbePool, TrialTokenizer
from helios.frontend.inference import Conversation, InferenceRequest, OutputConstraint, RawPrompt
from helios.frontend.limits import RequestLimits
from helios.frontend.literal_text import LiteralEncoder
from helios.frontend.native_deepseek import NativeEncoder
from helios.frontend.prepare import Prepared, compile_output, prepare
from helios.frontend.prompt import REQUIRED_TOOL_INSTRUCTION, PreparedPrompt
from helios.frontend.prompt_images import ImageRejected, PromptImages, image_counters

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = ["Frontend", "ImageRejected", "Prepared", "PreparedPrompt", "REQUIRED_TOOL_INSTRUCTION"]


class Frontend:
    """Everything a protocol needs from the loaded core to prepare requests."""

    def __init__(self, core: Core, config: ServerConfig) -> None:
        m = core.manifest
        self.manifest = m
        self.config = config
        self.tokenizer = core.tokenizer()
        self.literal = LiteralEncoder(self.tokenizer)
        self.vocab_size = m.tokenizer.vocab_size
        self.max_model_len = m.limits.max_model_len
        self.bounds = InputBounds(self.max_model_len, longest_token_chars(self.tokenizer))
        # Only hybrid cores act on every checkpoint hint (attention cores' page cache covers every
        # boundary), so only they pay for finding them all; with a host prefix store, attention
        # cores get the conversation anchor alone (its chain is evicted last from host memory).
        self.checkpoint_hints = bool(m.kv.state)
        self.anchor_hints = not m.kv.state and config.host_cache
        source = core.chat_template()
        specials = {
            "bos_token": self._token(m.tokenizer.bos_token_id),
            "eos_token": self._token(m.tokenizer.eos_token_ids[0]),
            "pad_token": self._token(m.tokenizer.pad_token_id),
        }
        self.template = ChatTemplate(source, specials) if source else None
        self.native = NativeEncoder.for_source(
            m.recipe.template_source, self.tokenizer, m.recipe.effort_levels, m.recipe.default_effort
        )
        eos = tuple(m.tokenizer.eos_token_ids)
        probe = ProbePool(
            TrialTokenizer(self.tokenizer.to_str(), self.vocab_size, eos),
            config.grammar_workers,
            config.grammar_memory_mb << 20,
        )
        self.grammars = GrammarService(
            self.tokenizer, self.vocab_size, eos, probe=probe, cache_bytes=config.grammar_cache_mb << 20
        )
        self.vision = m.vision if m.capabilities.vision else None
        self.limits = RequestLimits.of(m, config, self.vision)
        self.image_counters = image_counters()  # the frontend's share of the image metrics
        self.images = PromptImages(self.vision, self.limits, config, self.image_counters) if self.vision else None

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    # ------------------------------------------------------------------ the route's call
    def prepare(
        self, request: InferenceRequest, request_id: str, prompts: Sequence[PreparedPrompt] | None = None
    ) -> Prepared:
        """Checks, grammar, prompts, limits and sampling: every engine request, ready to submit
        (`prompts`: the inputs already lowered)."""
        return prepare(self, request, request_id, prompts)

    # ------------------------------------------------------------------ its parts
    def prompt(self, source: Conversation | RawPrompt, output: OutputConstraint | None = None) -> PreparedPrompt:
        """One input's token ids (count_tokens and scoring use it alone)."""
        return lowering.prompt(self, source, output)

    def render(self, conversation: Conversation, output: OutputConstraint | None = None) -> str:
        return lowering.render(self, conversation, output)

    def rendering(self, conversation: Conversation, output: OutputConstraint | None = None) -> Rendering:
        return lowering.rendering(self, conversation, output)

    def check_options(self, request: InferenceRequest) -> None:
        check_options(request, self.manifest)

    def compile_output(self, output: OutputConstraint) -> LLMatcher:
        return compile_output(self, output)

    def max_tokens(self, request: InferenceRequest, prompt_len: int) -> int:
        return self.limits.output_limit(request, prompt_len)

    # ------------------------------------------------------------------ what /v1/models advertises
    @property
    def default_max_tokens(self) -> int:
        """The output budget of a request that omits one ([server] default_max_tokens, else the
        whole context). The remaining context bounds it per request."""
        return self.limits.default_max_tokens

    def image_limits(self) -> dict[str, int]:
        """The /v1/models image fields at the served context (none for a text-only core)."""
        return self.limits.image_limits(self.vision)
