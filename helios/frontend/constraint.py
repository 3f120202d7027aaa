"""Structured output in the engine: one choice's grammar state, and the batched mask hook.

The constraint applies to the final answer only. Reasoning opens and closes only at its
single-token delimiters; a tool opener before the answer starts releases the choice
from the constraint (the call's envelope stays free). Once the grammar has consumed a
token, every later token goes through it, so the answer may spell a delimiter as text.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import llguidance
import torch

from helios.engine import MaskRow


class Phase(enum.Enum):
    REASONING = "reasoning"  # free: inside reasoning, until the close token
    START = "start"  # the answer has not begun: the grammar, the reasoning opener or a tool opener
    ANSWER = "answer"  # every token goes through the grammar
    FREE = "free"  # abandoned for this choice (a tool call began)


@dataclass(frozen=True, slots=True)
class ConstraintPlan:
    """Where the answer starts, for one request; token ids are the core's."""

    open_id: int | None  # single-token reasoning opener; None: reasoning cannot open under the constraint
    close_id: int | None  # single-token reasoning close
    tool_opener_ids: frozenset[int]  # single tokens that start a tool call (empty when tools are off)
    starts_in_reasoning: bool  # the prompt pre-opened reasoning


class GrammarConstraint:
    """A TokenConstraint (helios.engine) over an llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, plan: ConstraintPlan) -> None:
        self.matcher = matcher  # this choice's own copy (the request's template is never advanced)
        self.plan = plan
        self.phase = Phase.REASONING if plan.starts_in_reasoning else Phase.START
        self.reasoning_seen = plan.starts_in_reasoning  # reasoning opens at most once per output
        self._error: str | None = None

    @property
    def active(self) -> bool:
        return self.phase in (Phase.START, Phase.ANSWER)

    @property
    def error(self) -> str | None:
        if self._error is None and self.matcher.is_error():
            return self.matcher.get_error()
        return self._error

    @property
    def extra_ids(self) -> tuple[int, ...]:
        """Tokens allowed beside the grammar's own: the openers, before the answer begins."""
        if self.phase is not Phase.START:
            return ()
        opener = (self.plan.open_id,) if self.plan.open_id is not None and not self.reasoning_seen else ()
        return opener + tuple(self.plan.tool_opener_ids)

    def fork(self) -> GrammarConstraint:
        copy = GrammarConstraint(self.matcher.deep_copy(), self.plan)
        copy.phase, copy.reasoning_seen, copy._error = self.phase, self.reasoning_seen, self._error
        return copy

    def advance(self, token_id: int) -> bool:
        plan = self.plan
        if self.phase is Phase.FREE:
            return True
        if self.phase is Phase.REASONING:
            if token_id == plan.close_id:
                self.phase = Phase.START
            elif token_id in plan.tool_opener_ids:  # a tool opener also ends reasoning (Qwen)
                self.phase = Phase.FREE
            return True
        if self.phase is Phase.START:
            if token_id == plan.open_id and not self.reasoning_seen:
                self.phase, self.reasoning_seen = Phase.REASONING, True
                return True
            if token_id in plan.tool_opener_ids:
                self.phase = Phase.FREE
                return True
            self.phase = Phase.ANSWER
        if self.matcher.consume_token(token_id):
            return True
        self._error = f"token {token_id} does not continue the output grammar"
        return False


class GrammarMasks:
    """The engine's mask hook: masks of every active constraint of a step in one llguidance call.

    llguidance fills a packed bitmask [rows, ceil(V / 32)] int32 (on `num_threads` threads);
    a byte lookup table unpacks it to bool [B, V]. Rows without an active constraint allow
    every token.
    """

    def __init__(self, vocab_size: int, num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads)
        self._bitmask = torch.zeros(0, self.words, dtype=torch.int32)
        assert sys.byteorder == "little", "the packed mask is unpacked byte by byte, low bit first"
        self._bits_of_byte = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]

    def __call__(self, rows: Seq[MaskRow]) -> torch.Tensor | None:
        active = [
            (index, c) for index, r in enumerate(rows) if isinstance(c := r.constraint, GrammarConstraint) and c.active
        ]
        if not active:
            return None
        num = len(active)
        if self._bitmask.shape[0] < num:
            self._bitmask = torch.zeros(max(num, 2 * self._bitmask.shape[0]), self.words, dtype=torch.int32)
        bitmask = self._bitmask
        self.executor.unsafe_compute_mask_ptr(
            [(c.matcher, k) for k, (_, c) in enumerate(active)], bitmask.data_ptr(), self.words * 4, bitmask.shape[0]
        )
        packed = bitmask[:num].view(torch.uint8).flatten().int()  # [num * words * 4]
        bits = self._bits_of_byte.index_select(0, packed).view(num, -1)  # [num, words * 32]
        allowed = torch.ones(len(rows), self.vocab_size, dtype=torch.bool)  # [B, V]
        allowed[torch.tensor([row for row, _ in active])] = bits[:, : self.vocab_size]
        for row, constraint in active:
            if constraint.matcher.is_error():
                allowed[row] = False  # the engine finishes this choice with the matcher's error
            elif constraint.extra_ids:
                allowed[row, list(constraint.extra_ids)] = True
        return allowed
