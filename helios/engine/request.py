"""Boundary types of the engine: what goes in (EngineRequest) and what comes out (EngineEvent)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from helios.engine.logprobs import RankedLogprob, TokenLogprobs
from helios.engine.sampling_params import SamplingParams


class FinishCause(enum.Enum):
    EOS = "eos"  # an end-of-sequence token was generated and honored
    STOP_TOKEN = "stop_token"  # a stop_token_ids / stop_token_sequences match
    LENGTH = "length"  # max_tokens, the context limit, or KV capacity
    ABORT = "abort"  # cancelled by the caller (or a frontend string stop)
    ERROR = "error"  # execution failed; `error` says why


class ReasoningGate(Protocol):
    """Whether a forced reasoning close may follow a choice's output so far: the frontend's reading of
    tool openers in reasoning (one that still waits for the text that decides it, or a call that
    ended reasoning). The engine asks only at the cap, each choice its own fork."""

    def fork(self) -> ReasoningGate:
        """An independent copy that has read no output (the request's copy stays pristine)."""
        ...

    def allows_close(self, token_ids: Sequence[int], start: int) -> bool:
        """Read the output token_ids[start:] past what it has read, then answer."""
        ...


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    """A hard cap on reasoning tokens of an output that starts inside reasoning: at the cap the
    single-token close delimiter is forced, where the gate and the output grammar allow it."""

    budget: int  # reasoning tokens allowed, counted from the start of this request's output
    open_id: int | None  # the opener, where it is one token (multi-part openers, e.g. Gemma 4's, are not)
    close_id: int  # the single-token close delimiter
    implicit_close_ids: frozenset[int] = frozenset()  # tokens that also end reasoning (openers that always call)
    gate: ReasoningGate | None = None  # tool openers in reasoning the frontend decides (None: none to decide)


class TokenConstraint(Protocol):
    """One choice's output constraint. The frontend builds it; the engine only drives it: the
    mask hook reads it before sampling, and every committed token (forced ones too) advances it."""

    @property
    def active(self) -> bool:
        """Whether the next token is masked (False inside reasoning, tool calls, or once abandoned)."""
        ...

    @property
    def error(self) -> str | None:
        """Why the constraint cannot continue, once it cannot."""
        ...

    def advance(self, token_id: int) -> bool:
        """Commit one token; False when the constraint rejects it (`error` says why)."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state (one per choice; the request's copy stays pristine)."""
        ...


class MaskRow(Protocol):
    """One sampling row as the mask hook sees it: a running choice, or a row after drafts (its
    choice's constraint advanced through the drafts before it). The hook reads only this."""

    @property
    def constraint(self) -> TokenConstraint | None:
        """The row's constraint state; None for an unconstrained choice."""
        ...


@dataclass(frozen=True, slots=True)
class EngineImage:
    """One image of a prompt: the token span its vision features fill, and how to make them.

    The engine prepares and encodes an image only when a prefill chunk reaches its span, so an
    image inside a reused prefix costs neither (engine/images.py)."""

    start: int  # prompt position of its first image token
    num_tokens: int  # image-token rows (= vision feature rows); framing tokens around the span are outside it
    digest: bytes  # content and processing settings: the prefix identity of pages from its span on
    prepare: Callable[[], list[tuple[Any, Any]]]  # -> per view, (pixel_values [X, D], pixel_positions [X, 2])
    pixels: int = 0  # decoded width * height, for metrics
    # Tiled images: (offset from start, rows) runs of feature rows in feature order, framing tokens
    # between them (rows sum to num_tokens, offsets increasing, the first 0); () is one run.
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        """One past the last image-token position."""
        if not self.runs:
            return self.start + self.num_tokens
        offset, rows = self.runs[-1]
        return self.start + offset + rows

    def spans(self) -> list[tuple[int, int, int]]:
        """(first prompt position, first feature row, rows) of each run."""
        if not self.runs:
            return [(self.start, 0, self.num_tokens)]
        out, row = [], 0
        for offset, rows in self.runs:
            out.append((self.start + offset, row, rows))
            row += rows
        return out

    def covers(self, position: int) -> bool:
        """Whether a prompt position holds one of this image's feature rows (not framing)."""
        if not self.start <= position < self.end:
            return False
        return any(p <= position < p + n for p, _, n in self.spans())


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt to continue, with n sampled choices sharing its prefill.

    Every field is validated by the frontend; the engine trusts them.
    """

    request_id: str
    prompt_ids: tuple[int, ...]  # nonempty; len(prompt_ids) + max_tokens <= max_model_len
    params: tuple[SamplingParams, ...]  # one per choice (seeds already advanced by choice index)
    max_tokens: int  # generated tokens per choice; 0 only with prompt_logprobs (score, then stop)
    stop_token_ids: frozenset[int] = frozenset()  # single-token stops
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stops, matched on output suffixes
    ignore_eos: bool = False  # EOS tokens do not end generation
    num_top_logprobs: int | None = None  # None: no generation logprobs; 0..max_top_logprobs alternatives
    logprob_token_ids: tuple[int, ...] = ()  # explicit ids (deduplicated) replacing natural alternatives
    prompt_logprobs: int | None = None  # None: none; 0..20 alternatives per prompt position
    cache_identity: bytes = b""  # prefix-cache identity slot (image / processing settings)
    reasoning_budget: ReasoningBudget | None = None  # only when output starts inside reasoning
    use_prefix_cache: bool = True
    constraint: TokenConstraint | None = None  # pristine; each choice runs its own fork()
    # Candidate prefix-checkpoint boundaries from the prompt's structure: (token position, role),
    # 0 < position <= len(prompt_ids), role "anchor" (end of the leading system/tools block),
    # "message" (a message end) or "cache_control" (a marked block's end). Advisory: hybrid cores
    # choose among them under a work allowance (checkpoints.py); attention cores ignore them.
    checkpoint_hints: tuple[tuple[int, str], ...] = ()
    images: tuple[EngineImage, ...] = ()  # ordered by start, spans disjoint and inside the prompt

    @property
    def n(self) -> int:
        return len(self.params)

    def page_identity(self, index: int, page_tokens: int) -> bytes:
        """The identity slot of full page `index`: cache_identity, plus the digest of every image
        that starts before the page ends, so pages before the first image stay shared with
        requests that differ only later, and no page at or after an image is reused for another."""
        end = (index + 1) * page_tokens
        digests = [image.digest for image in self.images if image.start < end]
        return self.cache_identity + b"".join(digests) if digests else self.cache_identity


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """New output of one choice since its previous event."""

    request_id: str
    choice_index: int
    token_ids: tuple[int, ...]  # newly committed tokens (including a terminating EOS / stop token)
    logprobs: tuple[TokenLogprobs | None, ...] | None  # parallel to token_ids; None for forced tokens
    finish: FinishCause | None = None  # set on the choice's last event
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    stop_match_len: int = 0  # trailing tokens of this choice that form the matched token stop
    prompt_logprobs: tuple[dict[int, RankedLogprob] | None, ...] | None = None  # first event only
    prompt_chunk_ends: tuple[int, ...] | None = None  # first event only: prompt position where each scored chunk ended
    error: str | None = None


IMAGE_COUNTERS = (
    "input_decoded_images_total",  # images decoded by the frontend (header checks passed)
    "input_rejected_images_total",  # images refused (format, size, pixels, tokens, budget)
    "input_decoded_image_bytes_total",  # encoded bytes of decoded images
    "input_prepared_images_total",  # images resized / normalized / patchified by the engine
    "input_reused_images_total",  # images inside a reused prefix: neither prepared nor encoded
    "input_vision_encodes_total",  # vision program runs
    "input_vision_tokens_total",  # feature rows they produced
    "input_feature_evictions_total",  # images evicted from the feature arena before use (re-encoded later)
    "input_prepared_cache_hits_total",  # images whose features came from the prepared-input cache (not re-encoded)
    "input_prepared_cache_evictions_total",  # features dropped from that cache for newer ones
    "input_prepared_cache_bytes",  # gauge: feature bytes that cache holds
)


@dataclass
class EngineStats:
    """Counters the engine owns (spec "Health and metrics"); read racily by /metrics."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    completed: int = 0
    failed: int = 0
    reused_tokens: int = 0
    verification_rounds: int = 0  # progressing decode request rounds, with or without drafts
    verification_drafts: int = 0  # draft tokens offered in those rounds (rejected ones included)
    accepted_drafts: int = 0  # drafts accepted by verification (the bonus / correction token excluded)
    draft_rounds: int = 0  # request rounds that offered at least one draft
    verify_steps: int = 0  # steps that ran decode or verification rows
    draft_steps: int = 0  # draft positions the learned drafter ran (each proposed draft token; 0 without one)
    learned_offered: int = 0  # of verification_drafts, those the learned drafter proposed
    learned_accepted: int = 0  # of accepted_drafts, those the learned drafter proposed
    rounds_by_depth: dict[int, int] = field(default_factory=dict)  # drafts offered -> request rounds
    steps_by_batch: dict[int, int] = field(default_factory=dict)  # decode rows in a verification step -> steps
    steps_by_width: dict[int, int] = field(default_factory=dict)  # widest row group (1 + drafts) -> steps
    reasoning_budget_cuts: int = 0  # requests whose reasoning was closed by their budget
    preemptions: int = 0  # running sequences preempted (pages released, recomputed later) to let older ones grow
    steps: int = 0
    active: int = 0
    pending: int = 0
    cached_pages: int = 0
    free_pages: int = 0
    total_pages: int = 0
    page_tokens: int = 0
    decode_weight_bytes: int = 0
    state_slots: int = 0  # hybrid cores: recurrent-state slots (live plus snapshot), 0 for others
    state_slot_bytes: int = 0  # bytes of one slot over every recurrent layer
    state_slots_used: int = 0  # live slots held by running sequences
    state_snapshots: int = 0  # prefix snapshots held
    state_rewinds: int = 0  # hybrid cores: speculative rounds whose rejected drafts rewound the state
    # Step timing (api.md replay_*): wall time of completed steps' program runs and sampling (on
    # CUDA sampling waits for the device, so this covers its work), host-store restore copies
    # included; and the waits for host-store data (the restore copies before a step, and the
    # engine idling on a disk prefetch), with the steps that carried restores.
    replay_ns: int = 0
    readiness_wait_ns: int = 0
    readiness_samples: int = 0
    checkpoint_anchor_reservations: int = 0  # unused anchor guards (snapshot slots kept for anchors)
    # Image preparation and feature counters (spec metrics "input_*"), under their Prometheus names
    # without flare_; the frontend adds its decode counters to the same table.
    images: dict[str, int] = field(default_factory=lambda: dict.fromkeys(IMAGE_COUNTERS, 0))

    checkpoint_captures: dict[str, int] = field(default_factory=dict)  # role -> state snapshots captured
    checkpoint_skips: dict[str, int] = field(default_factory=dict)  # reason -> captures not made
    checkpoint_extra_work_ns: int = 0  # predicted extra prefill and copy work charged for hinted captures

    def count_checkpoint_capture(self, role: str) -> None:
        self.checkpoint_captures[role] = self.checkpoint_captures.get(role, 0) + 1

    def count_checkpoint_skip(self, reason: str) -> None:
        self.checkpoint_skips[reason] = self.checkpoint_skips.get(reason, 0) + 1

    def count_round(self, drafts: int) -> None:
        self.rounds_by_depth[drafts] = self.rounds_by_depth.get(drafts, 0) + 1

    def count_verify_step(self, rows: int, width: int) -> None:
        self.verify_steps += 1
        self.steps_by_batch[rows] = self.steps_by_batch.get(rows, 0) + 1
        self.steps_by_width[width] = self.steps_by_width.get(width, 0) + 1
