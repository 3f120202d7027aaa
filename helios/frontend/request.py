"""Lowering neutral requests into engine requests: chat template, tokens, limits, sampling.

Validation that every protocol shares lives here (logprob capacity, stops, context,
sampling ranges), so each rule is written once.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from helios.config import ServerConfig
from helios.core import Core
from helios.core.template import ChatTemplate, TemplateError, check_template_kwargs
from helios.engine.logprobs import validate_logprob_token_ids
from helios.engine.request import IMAGE_COUNTERS, EngineImage, EngineRequest, ReasoningBudget
from helios.frontend.image_cache import DecodedImages
from helios.frontend import images as imaging
from helios.engine.sampling_params import SamplingRequestError, resolve_sampling
from helios.frontend.bounds import InputBounds, longest_token_chars
from helios.frontend.checkpoints import Rendering, character_hints, token_hints
from helios.frontend.constraint import ConstraintPlan, GrammarConstraint
from helios.frontend.grammar import GrammarError, GrammarService
from helios.frontend.grammar_probe import ProbePool, TrialTokenizer
from helios.frontend.literal_text import LiteralEncoder
from helios.frontend.native_deepseek import NativeEncoder
from helios.frontend.parsers.reasoning import reasoning_delimiters, starts_in_reasoning, token_delimiters
from helios.frontend.parsers.tools import tool_opener_ids
from helios.frontend.inference import (
    Conversation,
    ImagePart,
    InferenceRequest,
    Message,
    OutputConstraint,
    RawPrompt,
    ReasoningPart,
    RequestError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 4096
MAX_TOKEN_STOPS = 16
MAX_TOKEN_STOP_LEN = 64
MAX_LOGPROBS = 20
EFFORT_ORDER = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REQUIRED_TOOL_INSTRUCTION = "You must answer by calling at least one of the provided tools."
JSON_OBJECT_INSTRUCTION = "Respond with only a JSON object, and no other text."
JSON_SCHEMA_INSTRUCTION = "Respond with only a JSON value that conforms to this JSON schema, and no other text:\n"


def output_instruction(output: OutputConstraint | None) -> str | None:
    """The system-prompt instruction for conversational JSON output (grammars get none)."""
    if output is None or output.kind not in ("json_schema", "json_object"):
        return None
    return JSON_SCHEMA_INSTRUCTION + output.definition if output.kind == "json_schema" else JSON_OBJECT_INSTRUCTION


def normalize_tool_results(messages: list[Message]) -> list[Message]:
    """Parallel tool results go back into the preceding assistant's call order.

    Only a run of tool messages directly after an assistant message with calls is
    reordered, and only when its ids are unique and exactly match calls of that message.
    """
    out = list(messages)
    for index, message in enumerate(out):
        calls = [p.call_id for p in message.parts if isinstance(p, ToolCallPart)] if message.role == "assistant" else []
        if len(calls) < 2:
            continue
        end = index + 1
        while end < len(out) and out[end].role == "tool":
            end += 1
        run = out[index + 1 : end]
        ids = [next((p.call_id for p in m.parts if isinstance(p, ToolResultPart)), None) for m in run]
        if len(set(ids)) != len(ids) or not set(ids) <= set(calls) or None in ids:
            continue
        out[index + 1 : end] = sorted(run, key=lambda m: calls.index(ids[run.index(m)]))
    return out


def nearest_effort(level: str, accepted: tuple[str, ...]) -> str:
    """A neutral effort level resolved against the template's vocabulary (closest rank)."""
    if level in accepted:
        return level
    if level not in EFFORT_ORDER:
        raise RequestError(f"unknown reasoning effort {level!r} (accepted: {', '.join(accepted)})", "effort")
    rank = EFFORT_ORDER.index(level)
    ranked = [a for a in accepted if a in EFFORT_ORDER]
    return (
        min(ranked, key=lambda a: (abs(EFFORT_ORDER.index(a) - rank), -EFFORT_ORDER.index(a)))
        if ranked
        else accepted[0]
    )


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    text: str | None  # rendered chat text or the raw prompt text (None for token-id prompts)
    checkpoint_hints: tuple[tuple[int, str], ...] = ()  # EngineRequest.checkpoint_hints (frontend/checkpoints.py)
    images: tuple[EngineImage, ...] = ()  # EngineRequest.images: each image's token span, in prompt order

    @property
    def image_tokens(self) -> int:
        """Image feature tokens in the prompt (usage multimodal_tokens.image; framing excluded)."""
        return sum(image.num_tokens for image in self.images)

    @property
    def image_positions(self) -> frozenset[int]:
        """Prompt positions filled by image features (their prompt logprobs are null)."""
        return frozenset(p for image in self.images for p in range(image.start, image.end) if image.covers(p))


TEXT_ONLY_IMAGES = "this model does not accept images (its core has no vision program)"


class ImageRejected(RequestError):
    """A 400 about the request's images (limits, budget, format), not its text or template."""


def message_images(messages: list[Message]) -> list[ImagePart]:
    """The images of lowered messages in the order the template renders them (tool results' inline)."""
    out: list[ImagePart] = []
    for message in messages:
        for part in message.parts:
            if isinstance(part, ImagePart):
                out.append(part)
            elif isinstance(part, ToolResultPart):
                out += [p for p in part.content if isinstance(p, ImagePart)]
    return out


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
        self.image_counters = dict.fromkeys(IMAGE_COUNTERS[:3], 0)  # the frontend's share of the image metrics
        self.image_counters["input_decode_cache_hits_total"] = 0  # images not decoded again (image_cache.py)
        self.decoded_images = DecodedImages(config.image_cache_mb << 20)
        framing = len(self.vision.prefix_token_ids) + len(self.vision.suffix_token_ids) if self.vision else 0
        # Context-derived limits at the served context (spec /v1/models), within the core's own.
        self.max_image_tokens_per_prompt = (
            min(self.vision.max_image_tokens_per_prompt, max(0, self.max_model_len - 1 - framing)) if self.vision else 0
        )
        self.max_images_per_prompt = (
            min(self.vision.max_images_per_prompt, max(0, (self.max_model_len - 1) // (1 + framing)))
            if self.vision
            else 0
        )

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    # ------------------------------------------------------------------ prompts
    def render(self, conversation: Conversation, output: OutputConstraint | None = None) -> str:
        return self._rendering(conversation, output).text

    def _rendering(self, conversation: Conversation, output: OutputConstraint | None) -> Rendering:
        template = self.template
        if template is None:
            raise RequestError("this model has no chat template; use /v1/completions with a raw prompt", "messages")
        lowered, presented = self._lowered(conversation, output)
        messages = [self._template_message(m) for m in lowered]
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in presented
        ] or None
        kwargs = self._reasoning_kwargs(conversation)
        try:
            check_template_kwargs(kwargs)
            text = template.render(
                messages,
                tools=tools,
                add_generation_prompt=conversation.add_generation_prompt,
                continue_final_message=conversation.continue_final_message,
                **kwargs,
            )
        except TemplateError as exc:
            raise RequestError(str(exc), "messages") from None
        return Rendering(
            text,
            lowered,
            messages,
            lambda prefix: template.render(prefix, tools=tools, add_generation_prompt=False, **kwargs),
            tools is not None,
        )

    def _lowered(
        self, conversation: Conversation, output: OutputConstraint | None, native: bool = False
    ) -> tuple[list[Message], list[ToolSpec]]:
        """The arranged messages and the tools presented to the model. A native encoder writes its
        own required-call and response-format prompts, so it gets no added instructions."""
        choice = conversation.tool_choice
        presented = [t for t in conversation.tools if choice.mode != "named" or t.name == choice.name]
        if choice.mode == "none":
            presented = []
        arranged = self._arrange(conversation.messages)
        if choice.mode == "required" and not native:
            arranged = self._with_instruction(arranged, REQUIRED_TOOL_INSTRUCTION)
        instruction = None if native else output_instruction(output)
        if instruction is not None:
            arranged = self._with_instruction(arranged, instruction)
        return normalize_tool_results(arranged), presented

    def _reasoning_kwargs(self, conversation: Conversation) -> dict[str, object]:
        """Template variables for reasoning controls; explicit chat_template_kwargs win."""
        kwargs = dict(conversation.template_kwargs)
        if conversation.thinking is not None:  # Messages' thinking switch; templates without it ignore it
            kwargs.setdefault("enable_thinking", conversation.thinking)
        levels = self.manifest.recipe.effort_levels
        if conversation.effort is not None and levels:
            kwargs.setdefault("reasoning_effort", nearest_effort(conversation.effort, levels))
        return kwargs

    @staticmethod
    def _with_instruction(messages: list[Message], text: str) -> list[Message]:
        """Append an instruction to the leading system message (creating one if needed)."""
        if messages and messages[0].role == "system":
            lead = messages[0]
            return [Message("system", (TextPart(f"{lead.text()}\n\n{text}" if lead.text() else text),))] + messages[1:]
        return [Message("system", (TextPart(text),))] + messages

    def _arrange(self, messages: tuple[Message, ...]) -> list[Message]:
        """System/developer merging and the inline-system fallback (spec: conversation semantics)."""
        if any(m.role == "developer" for m in messages):
            sections = [m for m in messages if m.role in ("system", "developer")]
            merged = "\n\n".join(f"{m.role}:\n{m.text()}" for m in sections if m.text())
            rest = [m for m in messages if m.role not in ("system", "developer")]
            return ([Message("system", (TextPart(merged),))] if merged else []) + rest
        arranged: list[Message] = []
        inline = None
        for index, message in enumerate(messages):
            if message.role == "system" and not message.text():
                continue  # empty system messages produce no prompt text
            if message.role == "system" and index > 0 and any(m.role != "system" for m in messages[:index]):
                if inline is None:
                    renderer = self.native or self.template
                    inline = renderer.supports_inline_system() if renderer else False
                if not inline:
                    message = Message("user", (TextPart(f"<system>{message.text()}</system>"),))
            arranged.append(message)
        return arranged

    def _template_message(self, message: Message) -> dict[str, object]:
        out: dict[str, object] = {"role": message.role}
        texts, calls, reasoning = [], [], []
        items: list[dict[str, str]] = []
        vision = self.vision is not None
        for part in message.parts:
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, ReasoningPart):
                reasoning.append(part.text)
            elif isinstance(part, ToolCallPart):
                try:
                    arguments = json.loads(part.arguments) if part.arguments else {}
                except json.JSONDecodeError:
                    raise RequestError(f"tool call {part.call_id!r} arguments are not valid JSON", "messages") from None
                calls.append(
                    {"id": part.call_id, "type": "function", "function": {"name": part.name, "arguments": arguments}}
                )
            elif isinstance(part, ToolResultPart):
                out["tool_call_id"] = part.call_id
                if any(isinstance(p, ImagePart) for p in part.content) and not vision:
                    raise ImageRejected(f"{TEXT_ONLY_IMAGES}: tool result {part.call_id!r} carries one", "messages")
                result = "\n\n".join(p.text for p in part.content if isinstance(p, TextPart))
                if part.is_error:  # templates render no flag for it: say it in the result the model reads
                    out["is_error"] = True
                    result = f"Error: {result}" if result else "Error"
                texts += [result] if result else []
                items += [{"type": "text", "text": result}] if result else []
                items += [{"type": "image"} for p in part.content if isinstance(p, ImagePart)]
                continue
            elif isinstance(part, ImagePart):
                if not vision:
                    raise ImageRejected(TEXT_ONLY_IMAGES, "messages")
                items.append({"type": "image"})
                continue
            if isinstance(part, TextPart):
                items.append({"type": "text", "text": part.text})
        # With images, the content is the template's list of text and image items, in order.
        out["content"] = items if any(i["type"] == "image" for i in items) else "\n\n".join(texts)
        if calls:
            out["tool_calls"] = calls
        if reasoning:
            out["reasoning_content"] = "\n\n".join(reasoning)
        if message.name:
            out["name"] = message.name
        return out

    def prompt(self, source: Conversation | RawPrompt, output: OutputConstraint | None = None) -> PreparedPrompt:
        self.bounds.check(source)  # from counts alone, before any rendering or tokenization
        if (
            isinstance(source, Conversation)
            and source.tools
            and source.tool_choice.mode in ("required", "named")
            and not self.manifest.recipe.tool_syntax
        ):
            raise RequestError(
                f"tool_choice {source.tool_choice.mode!r} needs a tool call, but this model's recipe "
                f"({self.manifest.recipe.name}) declares no tool-call syntax: use tool_choice auto or none",
                "tool_choice",
            )
        if isinstance(source, Conversation) and self.native is not None:
            messages, presented = self._lowered(source, output, native=True)
            ids, text = self.native.encode(source, messages, presented, self._reasoning_kwargs(source), output)
            return PreparedPrompt(ids, text)
        if isinstance(source, Conversation):  # client text's control-token strings stay plain text
            rendered: list[tuple[Conversation, Rendering]] = []

            def render(conversation: Conversation) -> str:
                rendered.append((conversation, self._rendering(conversation, output)))
                return rendered[-1][1].text

            pictures = self._check_images(message_images(self._lowered(source, output)[0])) if self.vision else []
            encoded = self.literal.encode_conversation(source, render)
            hints: tuple[tuple[int, str], ...] = ()
            if self.checkpoint_hints or self.anchor_hints:
                conversation, rendering = rendered[-1]  # the one whose text was encoded (placeholders and all)
                marks = [
                    (conversation.messages[i], j) for i, j in source.cache_marks if 0 <= i < len(conversation.messages)
                ]
                found = character_hints(rendering, marks, anchor_only=not self.checkpoint_hints)
                hints = token_hints(found, encoded.spans)
            if not pictures:
                return PreparedPrompt(tuple(encoded.ids), encoded.text, hints)
            ids, spans = self._expand_images(list(encoded.ids), [cost for _, _, cost in pictures])
            growth = [(old, grown) for old, _, grown, _ in spans]
            hints = tuple((self._shifted(pos, growth), role) for pos, role in hints)
            engine_images = tuple(
                self._engine_image(part, header, cost, start, runs)
                for (part, header, cost), (_, start, _, runs) in zip(pictures, spans)
            )
            return PreparedPrompt(tuple(ids), encoded.text, hints, engine_images)
        if source.token_ids is not None:
            if not source.token_ids:
                raise RequestError("a token-id prompt must not be empty", "prompt")
            bad = [t for t in source.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt"
                )
            return PreparedPrompt(tuple(source.token_ids), None)
        text = source.text or ""
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=True).ids)
        if not ids:
            bos = self.manifest.tokenizer.bos_token_id
            if bos is None:
                raise RequestError("an empty prompt needs a BOS token, and this model has none", "prompt")
            ids = (bos,)
        return PreparedPrompt(ids, text)

    # ------------------------------------------------------------------ images
    def image_limits(self) -> dict[str, int]:
        """The /v1/models image fields at the served context (zeros for a text-only core)."""
        v = self.vision
        if v is None:
            return {}
        return {
            "max_images_per_prompt": self.max_images_per_prompt,
            "max_image_tokens_per_prompt": self.max_image_tokens_per_prompt,
            "image_feature_window_tokens": v.image_feature_window_tokens,
            "max_image_tokens_per_image": min(v.max_image_tokens_per_image, v.image_feature_window_tokens),
            "max_image_pixels": v.max_image_pixels,
            "max_image_bytes": v.max_image_bytes,
        }

    def _check_images(self, parts: list[ImagePart]) -> list[tuple[ImagePart, imaging.ImageHeader, imaging.ImageCost]]:
        """Cost every image from its header (no decode), then refuse: single images against their
        limits with the observed size, then the whole request against the prompt budget, naming
        the first image past it. Returns (part, header, cost) per image, in prompt order."""
        profile = self.vision
        assert profile is not None
        if len(parts) > self.max_images_per_prompt:
            self.image_counters["input_rejected_images_total"] += len(parts)
            raise ImageRejected(
                f"the request has {len(parts)} images, over max_images_per_prompt {self.max_images_per_prompt}",
                "messages",
            )
        costed = []
        for number, part in enumerate(parts, 1):
            where = f"image {number}"
            try:
                header = imaging.read_header(part.data, profile, where)
                cost = imaging.cost(header.width, header.height, profile)
            except imaging.ImageError as exc:
                self.image_counters["input_rejected_images_total"] += 1
                raise ImageRejected(str(exc), "messages") from None
            if cost.num_tokens > profile.max_image_tokens_per_image:
                self.image_counters["input_rejected_images_total"] += 1
                raise ImageRejected(
                    f"{where} ({header.width}x{header.height} pixels) costs {cost.num_tokens} image "
                    f"tokens, over max_image_tokens_per_image {profile.max_image_tokens_per_image}",
                    "messages",
                )
            if cost.num_tokens < 2:
                self.image_counters["input_rejected_images_total"] += 1
                raise ImageRejected(
                    f"{where} ({header.width}x{header.height} pixels) resizes to {cost.num_tokens} image "
                    "token; this core's vision program needs at least 2",
                    "messages",
                )
            costed.append((part, header, cost))
        total = sum(c.num_tokens for _, _, c in costed)
        budget = self.max_image_tokens_per_prompt
        if total > budget:
            running, first = 0, 0
            for first, (_, _, c) in enumerate(costed, 1):  # noqa: B007 - read after the loop
                running += c.num_tokens
                if running > budget:
                    break
            _, header, c = costed[first - 1]
            patches = sum(c.num_patches for _, _, c in costed)
            self.image_counters["input_rejected_images_total"] += len(costed)
            raise ImageRejected(
                f"the request's {len(costed)} images cost {total} image tokens ({patches} patches), over "
                f"max_image_tokens_per_prompt {budget}; image {first} ({header.width}x{header.height} "
                f"pixels, {c.num_tokens} tokens) is the first past it",
                "messages",
            )
        return costed

    def _expand_images(
        self, ids: list[int], costs: list[imaging.ImageCost]
    ) -> tuple[list[int], list[tuple[int, int, int, tuple[tuple[int, int], ...]]]]:
        """Each template-rendered placeholder -> the profile's token layout (framing and one image
        token per feature row, imaging.token_layout). Returns the ids and, per image, (placeholder
        position before, first image-token position after, tokens added, EngineImage.runs)."""
        profile = self.vision
        assert profile is not None
        found = [i for i, t in enumerate(ids) if t == profile.placeholder_token_id]
        if len(found) != len(costs):
            raise RequestError(
                f"the chat template rendered {len(found)} image placeholders for {len(costs)} images", "messages"
            )
        out: list[int] = []
        spans: list[tuple[int, int, int, tuple[tuple[int, int], ...]]] = []
        previous = 0
        for position, cost in zip(found, costs):
            out += ids[previous:position]
            layout, runs = imaging.token_layout(cost, profile)
            first = runs[0][0]
            relative = tuple((offset - first, rows) for offset, rows in runs) if len(runs) > 1 else ()
            spans.append((position, len(out) + first, len(layout) - 1, relative))
            out += layout
            previous = position + 1
        return out + ids[previous:], spans

    @staticmethod
    def _shifted(position: int, growth: list[tuple[int, int]]) -> int:
        """A pre-expansion token position after image expansion: it moves by the growth of every
        placeholder before it."""
        return position + sum(grown for placeholder, grown in growth if placeholder < position)

    def _engine_image(
        self,
        part: ImagePart,
        header: imaging.ImageHeader,
        cost: imaging.ImageCost,
        start: int,
        runs: tuple[tuple[int, int], ...] = (),
    ) -> EngineImage:
        """Decode now (the frontend pool); prepare later, only if prefill reaches the image (the engine)."""
        profile = self.vision
        assert profile is not None
        digest = imaging.content_digest(part.data, profile)
        rgb = self.decoded_images.get(digest)
        if rgb is not None:
            self.image_counters["input_decode_cache_hits_total"] += 1
        else:
            try:
                rgb = imaging.decode(part.data)
            except Exception:
                self.image_counters["input_rejected_images_total"] += 1
                raise ImageRejected(
                    f"an image ({header.width}x{header.height} {header.format}) could not be decoded", "messages"
                ) from None
            self.image_counters["input_decoded_images_total"] += 1
            self.image_counters["input_decoded_image_bytes_total"] += header.num_bytes
            self.decoded_images.put(digest, rgb)
        return EngineImage(
            start=start,
            num_tokens=cost.num_tokens,
            digest=digest,
            prepare=functools.partial(imaging.prepare_views, rgb, profile),
            pixels=header.width * header.height,
            runs=runs,
        )

    # ------------------------------------------------------------------ engine requests
    @property
    def default_max_tokens(self) -> int:
        """The output budget of a request that omits one ([server] default_max_tokens, else the
        whole context); /v1/models advertises it. The remaining context bounds it per request."""
        configured = self.config.default_max_tokens
        return self.max_model_len if configured is None else min(configured, self.max_model_len)

    def max_tokens(self, request: InferenceRequest, prompt_len: int) -> int:
        """The output limit the engine gets: the request's (or the default), bounded by the
        context the prompt leaves, so reaching it reports the limit cause. Only a prompt that
        leaves no room for one output token is refused."""
        remaining = self.max_model_len - prompt_len
        if remaining < 1:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) leaves no room for output in the context of "
                f"{self.max_model_len} tokens",
                "prompt" if isinstance(request.input, RawPrompt) else "messages",
            )
        asked = self.default_max_tokens if request.max_tokens is None else request.max_tokens
        return min(asked, remaining)

    def check_options(self, request: InferenceRequest) -> None:
        caps = self.manifest.capabilities
        lp = request.logprobs
        if lp.top is not None and lp.top > caps.max_top_logprobs:
            raise RequestError(
                f"this model returns at most {caps.max_top_logprobs} alternatives per token (asked for {lp.top})",
                "top_logprobs",
            )
        if lp.token_ids:
            if not caps.explicit_logprob_ids:
                raise RequestError(
                    "this core has no explicit-id logprob inputs; re-export it without "
                    "--no-logprob-ids to use logprob_token_ids",
                    "logprob_token_ids",
                )
            try:
                validate_logprob_token_ids(list(lp.token_ids), self.vocab_size)
            except ValueError as exc:
                raise RequestError(str(exc), "logprob_token_ids") from None
        if lp.prompt is not None:
            if not caps.prompt_logprobs:
                raise RequestError(
                    "this core was exported without prompt logprobs; re-export it with "
                    "`ignition export --prompt-logprobs`",
                    "prompt_logprobs",
                )
            if lp.prompt > caps.max_top_logprobs:
                raise RequestError(
                    f"prompt_logprobs is at most {caps.max_top_logprobs} for this model", "prompt_logprobs"
                )
        if request.thinking_token_budget is not None and self.manifest.recipe.reasoning_syntax is None:
            raise RequestError(
                "thinking_token_budget needs a model with reasoning syntax; this core declares none",
                "thinking_token_budget",
            )
        stop = request.stop
        if len(stop.strings) > MAX_STOP_STRINGS or any(not s for s in stop.strings):
            raise RequestError(f"stop accepts at most {MAX_STOP_STRINGS} nonempty strings", "stop")
        if sum(len(s.encode()) for s in stop.strings) > MAX_STOP_BYTES:
            raise RequestError(f"stop strings total more than {MAX_STOP_BYTES} UTF-8 bytes", "stop")
        sequences = [(t,) for t in stop.token_ids] + list(stop.token_sequences)
        if len(sequences) > MAX_TOKEN_STOPS or any(not s or len(s) > MAX_TOKEN_STOP_LEN for s in sequences):
            raise RequestError(
                f"token stops accept at most {MAX_TOKEN_STOPS} nonempty sequences of at most {MAX_TOKEN_STOP_LEN} ids",
                "stop_token_ids",
            )
        if any(not 0 <= t < self.vocab_size for s in sequences for t in s):
            raise RequestError("stop token ids must lie inside the vocabulary", "stop_token_ids")
        if stop.strings and sequences:
            raise RequestError("a request cannot combine string stops with token stops", "stop")
        if request.output is not None:
            self._check_output(request)

    def _check_output(self, request: InferenceRequest) -> None:
        """Options an output constraint excludes (spec: reasoning, sampling, and usage)."""
        param = request.output.param  # type: ignore[union-attr]
        if not isinstance(request.input, Conversation):
            raise RequestError("output constraints apply to conversational requests only", param)
        if request.input.continue_final_message:
            raise RequestError("assistant continuation cannot be combined with an output constraint", param)
        stop = request.stop
        if stop.strings or stop.token_ids or stop.token_sequences:
            raise RequestError("custom stops cannot be combined with an output constraint", "stop")
        if stop.ignore_eos:
            raise RequestError("ignore_eos cannot be combined with an output constraint", "ignore_eos")

    def compile_output(self, output: OutputConstraint) -> None:
        """Compile (and cache) the constraint's grammar; run on the frontend pool before admission."""
        self._matcher(output)

    def _matcher(self, output: OutputConstraint):
        try:
            return self.grammars.compile(output.kind, output.definition, output.param)
        except GrammarError as exc:
            raise RequestError(exc.message, exc.field) from None

    def engine_request(
        self, request: InferenceRequest, request_id: str, prompt: PreparedPrompt, max_tokens: int, first_choice: int = 0
    ) -> EngineRequest:
        spec = self.manifest.recipe.sampling
        try:
            params = tuple(
                resolve_sampling(spec, request.sampling, choice_index=first_choice + i, vocab_size=self.vocab_size)
                for i in range(request.n)
            )
        except SamplingRequestError as exc:
            raise RequestError(str(exc), exc.param) from None
        lp = request.logprobs
        budget = request.thinking_token_budget
        if budget is None and isinstance(request.input, Conversation):
            budget = self.config.thinking_token_budget  # the operator default for conversational requests
        return EngineRequest(
            request_id=request_id,
            prompt_ids=prompt.token_ids,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(request.stop.token_ids),
            stop_token_sequences=tuple(request.stop.token_sequences),
            ignore_eos=request.stop.ignore_eos,
            num_top_logprobs=lp.top,
            logprob_token_ids=tuple(dict.fromkeys(lp.token_ids)),
            prompt_logprobs=lp.prompt,
            use_prefix_cache=self.config.prefix_cache,
            cache_identity=salt_identity(request.cache_salt),
            reasoning_budget=self.reasoning_budget(budget, prompt.token_ids) if budget is not None else None,
            constraint=self.constraint(request, prompt.token_ids) if request.output is not None else None,
            checkpoint_hints=prompt.checkpoint_hints,
            images=prompt.images,
        )

    def constraint(self, request: InferenceRequest, prompt_ids: tuple[int, ...]) -> GrammarConstraint:
        """The request's pristine constraint: free reasoning first where the prompt or model opens it."""
        assert request.output is not None
        recipe = self.manifest.recipe
        delimiters = token_delimiters(recipe.reasoning_syntax, self.tokenizer) if recipe.reasoning_syntax else None
        open_id, close_id = delimiters or (None, None)
        conversation = request.input
        tools_on = (
            isinstance(conversation, Conversation)
            and bool(conversation.tools)
            and conversation.tool_choice.mode != "none"
        )
        openers = (
            tool_opener_ids(recipe.tool_syntax, self.tokenizer) if tools_on and recipe.tool_syntax else frozenset()
        )
        inside = delimiters is not None and starts_in_reasoning(prompt_ids, delimiters[0], delimiters[1])
        return GrammarConstraint(self._matcher(request.output), ConstraintPlan(open_id, close_id, openers, inside))

    def reasoning_budget(self, budget: int, prompt_ids: tuple[int, ...]) -> ReasoningBudget | None:
        """The engine's hard cap, when output starts inside reasoning; None when it starts in content."""
        syntax = self.manifest.recipe.reasoning_syntax
        delimiters = reasoning_delimiters(syntax, self.tokenizer) if syntax else None
        if delimiters is None:
            raise RequestError(
                "thinking_token_budget needs reasoning syntax with single-token delimiters; "
                f"this model's ({syntax or 'none'}) has none",
                "thinking_token_budget",
            )
        open_id, close_id = delimiters
        if not starts_in_reasoning(prompt_ids, open_id, close_id):
            return None
        implicit = frozenset(t for t in (self.tokenizer.token_to_id("<tool_call>"),) if t is not None)
        return ReasoningBudget(budget, open_id, close_id, implicit if self.manifest.recipe.tool_syntax else frozenset())


def salt_identity(salt: str | None) -> bytes:
    """The prefix-cache identity of a cache salt: requests share cached pages only with the same one."""
    if salt is None:
        return b""
    return b"salt:" + hashlib.blake2b(salt.encode("utf-8"), digest_size=16).digest()
