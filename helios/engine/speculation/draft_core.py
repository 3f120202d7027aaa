"""A separate draft core as the learned drafter (`helios serve CORE --draft-core DRAFT`).

A small core with the target's tokenizer runs its own step program on its own paged cache,
indexed by the target's page ids (same page size): a sequence's draft KV lives at the same
pages as its target KV, so it is allocated, shared through the prefix cache and freed with
them. After each target step the draft computes every committed token it has not yet seen
(from where it left off; from the start of a page a fork copied or the host store restored,
since those copies carry only the target's caches), and its row at the last committed token
predicts the first draft; further drafts chain one position at a time. Chained rows are
speculative: rewritten by later committed rows before anything reads them, and kept in scratch
pages past the pool where the sequence has no page yet.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from helios.core import Core
from helios.core.manifest import Manifest
from helios.engine import precision
from helios.engine.executor import Executor
from helios.engine.request import EngineStats, FinishCause
from helios.engine.sequence import SchedulerOutput, Sequence
from helios.engine.speculation.drafter import DraftPicker
from helios.engine.speculation.mtp import DraftRows

log = logging.getLogger("helios.engine")


def incompatibility(target: Manifest, draft: Manifest) -> str | None:
    """Why `draft` cannot propose drafts for `target`, or None."""
    name = draft.public_id
    if target.files.get(target.tokenizer.file) != draft.files.get(draft.tokenizer.file):
        return (
            f"draft core {name!r} has a different tokenizer than {target.public_id!r} (tokenizer.json digests "
            "differ): a draft core must share the served core's tokenizer"
        )
    if (
        draft.tokenizer.vocab_size < target.tokenizer.vocab_size
        and draft.tokenizer.special_tokens != target.tokenizer.special_tokens
    ):
        return f"draft core {name!r} has other special tokens than {target.public_id!r}"
    if draft.limits.page_tokens != target.limits.page_tokens:
        return (
            f"draft core {name!r} pages hold {draft.limits.page_tokens} tokens, the served core's "
            f"{target.limits.page_tokens}: re-export it with --page-tokens {target.limits.page_tokens}"
        )
    if draft.kv.state:
        return f"draft core {name!r} has recurrent layers (a rejected draft would have advanced their state)"
    return None


class DraftCoreDrafter:
    """Proposes each running sequence's next drafts from a draft core (see the module)."""

    def __init__(
        self,
        core: Core,
        target: Manifest,
        num_pages: int,
        device: str,
        max_drafts: int,
        max_rows: int,
        chunk_rows: int,
        stats: EngineStats,
    ) -> None:
        why = incompatibility(target, core.manifest)
        if why is not None:
            raise ValueError(why)
        m = core.manifest
        self.name = m.public_id
        self.page_tokens = m.limits.page_tokens
        self.num_pages = num_pages
        self.scratch_per_seq = max_drafts // self.page_tokens + 2
        self.max_rows = max_rows
        self.chunk_rows = chunk_rows  # committed rows per sequence and step (a long prompt takes several)
        self.vocab = min(m.tokenizer.vocab_size, target.tokenizer.vocab_size)  # padded rows are never drafted
        self.max_len = m.limits.max_model_len
        upcast = (
            device == "cpu"
            and m.weights.dtype in ("bfloat16", "float16")
            and not precision.is_native(getattr(torch, m.weights.dtype))
        )
        self.executor = Executor(core, num_pages + self.scratch_per_seq * max_rows, device, 0, upcast)
        self.stats = stats
        self._frontier: dict[int, int] = {}  # id(seq) -> positions before it hold its committed draft KV
        self._proposals: dict[int, tuple[int, ...]] = {}  # id(seq) -> drafts for its next round
        self.picker = DraftPicker()  # the engine gives it its mask hook
        log.info("speculation: drafting with draft core %s (%s step)", self.name, self.executor.step_kind)

    # ------------------------------------------------------------------ LearnedDrafter
    def proposal(self, seq: Sequence) -> tuple[int, ...]:
        return self._proposals.get(id(seq), ())

    def forget(self, seq: Sequence) -> None:
        self._proposals.pop(id(seq), None)
        self._frontier.pop(id(seq), None)

    @property
    def num_tracked(self) -> int:
        return len(self._proposals) + len(self._frontier)

    # ------------------------------------------------------------------ after a step
    def observe(
        self, plan: SchedulerOutput, hidden: dict[int, Tensor], tables: dict[int, list[int]], depths: dict[int, int]
    ) -> None:
        """After update_from_output: the draft's committed rows of every sequence the step
        touched, then drafts for those in `depths` (id(seq) -> how many)."""
        del hidden  # a draft core computes its own
        self._proposals = {}
        size = self.page_tokens
        restored = {page for page, _ in plan.memory.host_in}
        scratch: dict[int, int] = {}  # id(seq) -> first scratch page, for those that will draft
        rows = DraftRows.empty()
        wanted: list[tuple[Sequence, int]] = []
        frontiers: dict[int, int] = {}  # kept once the rows are computed
        for chunk in plan.chunks:
            for seq in chunk.choices or (chunk.seq,):
                table = tables.get(id(seq))
                if seq.finish is FinishCause.ERROR or table is None:
                    continue
                first = self._frontier.get(id(seq))
                if first is None:  # first seen since admission: pages a fork or the host store filled lack draft KV
                    first = chunk.start if seq is chunk.seq else (chunk.start + chunk.num_tokens) // size * size
                    copied = [i for i, page in enumerate(table) if page in restored]
                    first = min([first] + [i * size for i in copied])
                covered = len(table) * size  # positions with a page of their own
                end = min(len(seq.token_ids), first + self.chunk_rows, self.max_len)
                drafts = seq.finish is None and id(seq) in depths and end == len(seq.token_ids)
                if drafts and len(scratch) < self.max_rows:
                    scratch[id(seq)] = self.num_pages + len(scratch) * self.scratch_per_seq
                    table = self._with_scratch(seq, end - 1 + depths[id(seq)], scratch[id(seq)])
                else:
                    drafts, end = False, min(end, covered)
                if first >= end:
                    continue
                rows.add(seq.token_ids[first:end], range(first, end), table, torch.empty(0), size)
                if seq.finish is None:
                    frontiers[id(seq)] = min(end, covered)  # rows in scratch pages are redone
                if drafts:
                    wanted.append((seq, rows.starts[-1] - 1))
        if not rows.token_ids:
            return
        logits = self._call(rows, [row for _, row in wanted] or [rows.starts[-1] - 1])
        self._frontier.update(frontiers)
        if not wanted:
            return
        picks = self.picker.pick(logits[:, : self.vocab], [(seq, seq.constraint) for seq, _ in wanted])
        # [seq, its drafts, grammar state]
        chain = [[seq, [pick[0]], pick[1]] for (seq, _), pick in zip(wanted, picks) if pick is not None]
        for step in range(1, max((depths[id(entry[0])] for entry in chain), default=1)):
            group = [
                e
                for e in chain
                if depths[id(e[0])] > step and len(e[0].token_ids) + step <= self.max_len and len(e[1]) == step
            ]
            if not group:
                break
            rows = DraftRows.empty()
            for seq, tokens, _ in group:
                position = len(seq.token_ids) - 1 + step
                table = self._with_scratch(seq, position, scratch[id(seq)])
                rows.add([tokens[-1]], range(position, position + 1), table, torch.empty(0), size)
            logits = self._call(rows, list(range(len(group))))[:, : self.vocab]
            for entry, pick in zip(group, self.picker.pick(logits, [(entry[0], entry[2]) for entry in group])):
                if pick is not None:
                    entry[1].append(pick[0])
                    entry[2] = pick[1]
        for seq, tokens, _ in chain:
            self._proposals[id(seq)] = tuple(tokens)
            self.stats.draft_steps += len(tokens)

    def _with_scratch(self, seq: Sequence, position: int, first: int) -> list[int]:
        """seq's page table extended by its scratch pages up to `position`."""
        table = list(seq.pages)
        return table + list(range(first, first + position // self.page_tokens + 1 - len(table)))

    def _call(self, rows: DraftRows, logits_rows: list[int]) -> Tensor:
        ex = self.executor
        inputs = rows.inputs(logits_rows, ex.device)
        if ex.explicit:
            inputs["logprob_token_ids"] = torch.zeros(len(logits_rows), 1, dtype=torch.int64, device=ex.device)
        outputs = ex.step(ex.weights, ex.kv, **inputs)
        return outputs["logits"]
