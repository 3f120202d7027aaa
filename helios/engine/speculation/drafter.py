"""Draft proposals for speculative decoding, and how many to offer.

Two sources: the history drafter below, and a learned drafter where the engine has one (a
core's MTP programs, mtp.py, or a separate draft core, draft_core.py), which proposes after
each step for the next (LearnedDrafter). A sequence takes its history's proposal when that
comes from a long match covering the whole depth (copying is what history predicts best),
else the learned one, else whatever history found.

The history drafter needs no model: coding agents re-emit what their context holds (files
they edit, JSON they were shown, earlier turns), so the tokens that followed the most
recent earlier occurrence of the sequence's last n tokens are a good guess at what comes
next. It looks in the sequence itself (prompt and output) and then in the shared decoded
history of the serving process (recent outputs of other requests of the same cache
identity: one tenant's outputs never draft another's).

Drafts never change what is generated: the engine verifies them against the target model
(engine.py), so a bad guess costs only the rows it occupied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

NGRAM_SIZES = (4, 3, 2)  # longest match first: longer contexts predict better


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    mode: str = "adaptive"  # "off" | "adaptive" (depth follows acceptance) | "fixed" (always max_drafts, tests)
    max_drafts: int = 6  # draft tokens per sequence and round
    row_budget: int | None = 8  # adaptive: decode rows + drafts per step; at or past it no drafts (compute-bound);
    # None: measured at startup (threads.measure_row_budget)
    shared_history: bool = True  # draft from other requests' recent outputs (same cache identity) too
    history_tokens: int = 1 << 16  # shared history kept, in tokens
    learned: bool = True  # use the engine's learned drafter (core MTP programs or a draft core) where it has one
    history: bool = True  # propose from n-gram history at all (False: learned drafts only, for tests)


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a token list last ended, kept up to date as the list grows.

    `latest[n][gram]` is the end (exclusive) of the most recent occurrence that ends before
    the list's last token, so a lookup of the list's own suffix finds an earlier one."""

    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=lambda: {n: {} for n in NGRAM_SIZES})
    indexed: int = 0  # n-grams ending at positions < indexed are in `latest`

    def catch_up(self, tokens: list[int], upto: int) -> None:
        for end in range(max(self.indexed, 1), upto + 1):
            for n, table in self.latest.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def follow(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[tuple[int, ...], int]:
        """(follow's tokens, the length of the suffix matched; 0 when none)."""
        length = len(tokens)
        self.catch_up(tokens, length - 1)  # every n-gram ending before the last token
        for n in NGRAM_SIZES:
            if length <= n:
                continue
            end = self.latest[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tuple(tokens[end : min(end + k, length)]), n
        return (), 0


class SharedHistory:
    """Recent decoded outputs of the serving process, per cache identity, bounded in tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: deque[tuple[bytes, list[int]]] = deque()
        self._tokens = 0
        self._index: dict[tuple[bytes, tuple[int, ...]], tuple[list[int], int]] = {}

    def add(self, identity: bytes, tokens: list[int]) -> None:
        if len(tokens) <= NGRAM_SIZES[-1] or self.max_tokens <= 0:
            return
        tokens = tokens[-self.max_tokens :]
        self._entries.append((identity, tokens))
        self._tokens += len(tokens)
        for n in NGRAM_SIZES:
            for end in range(n, len(tokens)):
                self._index[(identity, tuple(tokens[end - n : end]))] = (tokens, end)
        while self._tokens > self.max_tokens:
            _, old = self._entries.popleft()
            self._tokens -= len(old)
        if len(self._index) > 4 * self.max_tokens:  # entries of evicted outputs: rebuild from what is kept
            self._index = {}
            kept, self._entries, self._tokens = list(self._entries), deque(), 0
            for ident, toks in kept:
                self.add(ident, toks)

    def follow(self, identity: bytes, tokens: list[int], k: int) -> tuple[int, ...]:
        return self.match(identity, tokens, k)[0]

    def match(self, identity: bytes, tokens: list[int], k: int) -> tuple[tuple[int, ...], int]:
        for n in NGRAM_SIZES:
            if len(tokens) < n:
                continue
            hit = self._index.get((identity, tuple(tokens[-n:])))
            if hit is not None:
                source, end = hit
                return tuple(source[end : end + k]), n
        return (), 0


class LearnedDrafter(Protocol):
    """A model that proposes drafts (mtp.py, draft_core.py): the engine runs it after each step;
    the scheduler reads its proposals while planning the next and tells it when a sequence leaves."""

    name: str  # what /metrics reports as learned_drafter_name ("mtp", a draft core's id)
    picker: DraftPicker  # its greedy picks, under a constrained sequence's grammar (the engine sets the mask hook)

    def proposal(self, seq) -> tuple[int, ...]:
        """Drafts proposed for seq after the last step (empty when none)."""
        ...

    def forget(self, seq) -> None:
        """seq finished or was preempted: drop whatever is kept for it."""
        ...


def _bucket(decoding: int) -> int:
    """Decode-row counts compared together: 1, 2, 3-4, 5-8, 9-16, ..."""
    return 1 << max(0, decoding - 1).bit_length()


class PayoffGate:
    """Whether drafts pay at this many decoding sequences, judged by the engine's own steps.

    The row budget bounds what a step may verify, but whether verifying pays depends on the
    host (how much dearer a step of verification rows is than a plain decode step there) and
    on the traffic (how many drafts are accepted): on a 2-core Xeon with AMX, 16 distinct
    chats at temperature 0.2 with one draft each ran 45 ms steps for 20% fewer of them, a net
    loss. So the gate keeps, per bucket of decoding sequences, moving averages of the tokens
    committed per sequence and of the seconds taken by decode-only steps with drafts and without;
    their ratio is each arm's rate. Drafts go through while their arm is ahead, and one step in
    EXPLORE_EVERY goes to the arm that is behind, so a change in traffic (an agent starts
    re-emitting a file) is noticed. The ratio of averages, not an average of each step's rate:
    what an arm delivers is its tokens over its time, and an average of per-step rates counts a
    short step as much as a long one (drafted steps that commit little quickly and much slowly
    looked ahead of plain steps that beat them in tokens per second)."""

    EXPLORE_EVERY = 16
    ALPHA = 0.25  # weight of the newest step in each average

    def __init__(self) -> None:
        # (bucket, drafted) -> (tokens committed per sequence, seconds) per step, moving averages
        self._means: dict[tuple[int, bool], tuple[float, float]] = {}
        self._steps: dict[int, int] = {}  # bucket -> decode-only steps observed

    def _rate(self, bucket: int, drafted: bool) -> float | None:
        """An arm's committed tokens per sequence per second (None: not measured yet)."""
        means = self._means.get((bucket, drafted))
        return None if means is None else means[0] / means[1]

    def allow(self, decoding: int) -> bool:
        """Whether this step may carry drafts (a query: asking twice gives the same answer)."""
        bucket = _bucket(decoding)
        drafted, plain = self._rate(bucket, True), self._rate(bucket, False)
        if drafted is None:
            return True  # try drafts first
        if plain is None:
            return False
        explore = self._steps.get(bucket, 0) % self.EXPLORE_EVERY == self.EXPLORE_EVERY - 1
        return (drafted >= plain) != explore

    def observe(self, decoding: int, drafted: bool, committed: int, seconds: float) -> None:
        """A decode-only step of `decoding` sequences committed `committed` tokens in `seconds`."""
        if decoding <= 0 or seconds <= 0:
            return
        bucket = _bucket(decoding)
        tokens = committed / decoding
        old = self._means.get((bucket, drafted))
        self._means[(bucket, drafted)] = (
            (tokens, seconds)
            if old is None
            else (old[0] + self.ALPHA * (tokens - old[0]), old[1] + self.ALPHA * (seconds - old[1]))
        )
        self._steps[bucket] = self._steps.get(bucket, 0) + 1


MaskHook = Callable[[list], "Tensor | None"]  # rows' allowed-token masks [B, V] bool, from each row's
# `.constraint` (and `.request`): a Sequence, or a DraftRow for a row after drafts


@dataclass(frozen=True, slots=True)
class DraftRow:
    """A row after drafts as the mask hook sees it: its choice's constraint after the drafts before it."""

    request: Any  # EngineRequest
    constraint: object


class DraftPicker:
    """A learned drafter's greedy picks, under each sequence's grammar where it has one.

    A draft the grammar rejects is cut by the scheduler before verification, and with it every
    draft after it; so each pick is the likeliest token the sequence's constraint allows after
    the drafts before it (the engine's mask hook computes the masks, as for sampling), and the
    chain follows the constraint forward. Rows without a constraint take the plain argmax."""

    def __init__(self, mask_hook: MaskHook | None = None) -> None:
        self.mask_hook = mask_hook

    def pick(self, logits: Tensor, rows: list[tuple[Any, object | None]]) -> list[tuple[int, object | None] | None]:
        """logits [R, >= V]: per row (seq, its grammar state), the pick and the state after it,
        or None where the grammar allows nothing more (the chain stops there)."""
        allowed = None
        if self.mask_hook is not None and any(state is not None for _, state in rows):
            allowed = self.mask_hook([DraftRow(seq.request, state) for seq, state in rows])
        if allowed is not None:
            vocab = min(logits.shape[1], allowed.shape[1])
            logits = logits[:, :vocab].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))
        tokens = logits.argmax(dim=-1).tolist()
        picks: list[tuple[int, object | None] | None] = []
        for index, ((_, state), token) in enumerate(zip(rows, tokens)):
            if state is None:
                picks.append((token, None))
                continue
            if allowed is not None and not bool(allowed[index].any()):
                picks.append(None)
                continue
            after = state.fork()  # type: ignore[attr-defined]
            picks.append((token, after) if after.advance(token) else None)
        return picks


class DraftMemory(Protocol):
    """What draft planning asks of the memory manager (memory/manager.py)."""

    def draft_room(self, seq) -> int:
        """Drafts seq's memory allows this round (a hybrid's rollback bound)."""
        ...

    def draft_pages(self, seq, count: int, keep_free: int) -> int:
        """Takes what up to `count` drafts need without preempting; how many have it."""
        ...


class Drafter:
    """Proposes drafts for decode sequences and adapts each one's depth to its acceptance."""

    def __init__(self, config: SpeculationConfig, stats=None, max_model_len: int = 1 << 62) -> None:
        self.config = config
        self.max_model_len = max_model_len  # a round's drafts and its correction token stay within it
        self.gate = PayoffGate()  # adaptive mode: whether drafts pay at this many sequences
        self.stats = stats  # EngineStats: the learned drafter's offered and accepted counts
        self.shared = SharedHistory(config.history_tokens if config.shared_history else 0)
        self._indexes: dict[int, NgramIndex] = {}  # id(seq) -> its index (dropped when it finishes)
        self.learned: LearnedDrafter | None = None  # set by the engine where it has one
        self._learned_round: set[int] = set()  # id(seq) of sequences whose drafts this round are learned

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off" and self.config.max_drafts > 0

    @property
    def learned_name(self) -> str | None:
        return self.learned.name if self.learned is not None and self.enabled else None

    # ------------------------------------------------------------------ planning a step
    def rows(self, running: list) -> int:
        """Draft tokens a step may add: adaptive speculation stops where decode rows alone reach the
        row budget (the step is compute-bound there, and drafts would only cost), and wherever its
        gate measured drafts losing to plain steps at this many sequences."""
        if not self.enabled:
            return 0
        if self.config.mode == "fixed":
            return 1 << 30
        decoding = sum(1 for s in running if s.num_pending == 1 and not s.scoring)
        if not self.gate.allow(decoding):
            return 0
        return max(0, (self.config.row_budget or 0) - decoding)

    def plan(self, seq, spare: int, memory: DraftMemory, keep_free: int) -> tuple[tuple[int, ...], tuple]:
        """Drafts for a decode sequence whose next page is secured, within `spare` rows and its
        limits, and for a constrained one the constraint before each verification row (its own,
        then forks advanced through each draft; drafts the grammar rejects are cut). Their pages come
        from `memory` without preempting (`keep_free` pages stay for the running sequences' growth)."""
        if spare <= 0 or seq.unforked or not may_draft(seq):
            return (), ()
        limit = min(spare, self.room(seq), memory.draft_room(seq))
        drafts = self.propose(seq, self.depth(seq, limit)) if limit > 0 else ()
        states: list = []
        if seq.constraint is not None and drafts:
            states.append(seq.constraint)
            for token in drafts:
                state = states[-1].fork()
                if not state.advance(token):
                    break
                states.append(state)
            drafts = drafts[: len(states) - 1]
        if drafts:
            drafts = drafts[: memory.draft_pages(seq, len(drafts), keep_free)]
        return drafts, tuple(states[: len(drafts) + 1]) if drafts else ()

    def depths(self, running: list, memory: DraftMemory) -> dict[int, int]:
        """id(seq) -> drafts the learned drafter should propose after this step for each running
        sequence's next round, sharing the step's spare rows oldest first as planning will; 0 (left
        out) where it could not draft or where its history's proposal wins anyway (propose)."""
        if not self.enabled or not self.config.learned:
            return {}
        spare = self.rows(running)
        depths: dict[int, int] = {}
        for seq in running:
            if spare <= 0:
                break
            if seq.num_pending != 1 or seq.scoring or seq.unforked or not may_draft(seq):
                continue
            k = self.depth(seq, min(spare, self.room(seq), memory.draft_room(seq)))
            if k > 0 and not self.history_wins(seq, k):
                depths[id(seq)] = k
                spare -= k
        return depths

    def room(self, seq) -> int:
        """Drafts seq may take within its limits: the correction or bonus token always follows."""
        return min(seq.request.max_tokens - seq.num_output - 1, self.max_model_len - len(seq.token_ids) - 1)

    def depth(self, seq, limit: int) -> int:
        """Drafts to try for seq this round, at most `limit`."""
        if self.config.mode == "fixed":
            return min(self.config.max_drafts, limit)
        return max(0, min(int(seq.draft_depth), self.config.max_drafts, limit))

    def history(self, seq, k: int) -> tuple[tuple[int, ...], int]:
        """(the history's proposal of up to k drafts, the length of the n-gram it matched)."""
        if k <= 0 or not self.config.history:
            return (), 0
        index = self._indexes.get(id(seq))
        if index is None:
            index = self._indexes[id(seq)] = NgramIndex()
        drafts, n = index.match(seq.token_ids, k)
        if not drafts and self.config.shared_history:
            drafts, n = self.shared.match(seq.request.cache_identity, seq.token_ids, k)
        return drafts, n

    def history_wins(self, seq, k: int) -> bool:
        """Whether history's proposal beats the learned drafter's: a longest-n-gram match that
        fills the whole depth (the engine then skips the learned chain for seq)."""
        drafts, n = self.history(seq, k)
        return n == NGRAM_SIZES[0] and len(drafts) >= k

    def propose(self, seq, k: int) -> tuple[int, ...]:
        self._learned_round.discard(id(seq))
        if k <= 0:
            return ()
        drafts, n = self.history(seq, k)
        if self.learned is None or not self.config.learned or (n == NGRAM_SIZES[0] and len(drafts) >= k):
            return drafts
        learned = self.learned.proposal(seq)[:k]
        if not learned:
            return drafts
        self._learned_round.add(id(seq))
        return learned

    def verified(self, seq, offered: int, accepted: int) -> None:
        """A round of seq was verified (whatever it committed): count the learned drafter's share."""
        if id(seq) in self._learned_round:
            self._learned_round.discard(id(seq))
            if self.stats is not None:
                self.stats.learned_offered += offered
                self.stats.learned_accepted += accepted

    def accepted(self, seq, offered: int, accepted: int) -> None:
        """Adaptive depth: one more than last round's accepted run, growing while all are accepted."""
        if offered == 0 or self.config.mode == "fixed":
            return
        seq.draft_depth = float(min(self.config.max_drafts, offered + 2 if accepted == offered else accepted + 1))

    def preempted(self, seq) -> None:
        """seq lost its pages: the learned drafter's state for it is void (its index stays)."""
        self._learned_round.discard(id(seq))
        if self.learned is not None:
            self.learned.forget(seq)

    def finished(self, seq) -> None:
        self._indexes.pop(id(seq), None)
        self._learned_round.discard(id(seq))
        if self.learned is not None:
            self.learned.forget(seq)
        if self.config.shared_history and seq.num_output > 0:
            self.shared.add(seq.request.cache_identity, seq.token_ids[seq.num_prompt :])

    @property
    def num_tracked(self) -> int:
        """Sequences this drafter keeps state for (tests: nothing is left after they end)."""
        return len(self._indexes) + len(self._learned_round)


def may_draft(seq) -> bool:
    """An open reasoning budget decodes one token at a time: its forced close depends on each
    committed token."""
    return not (seq.request.reasoning_budget is not None and seq.reasoning_open)


HistoryDrafter = Drafter  # the name before learned drafters joined
