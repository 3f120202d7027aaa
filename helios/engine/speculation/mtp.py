"""The MTP drafter: a core's multi-token-prediction programs ("mtp_draft.N") propose drafts.

After each step, MTP layer 0 runs over every position p the step computed whose next token
t[p+1] is now committed: t[p+1] joined with the step's hidden state at p, its KV written at p's
slot (the layout's "mtp_kv" caches, on the sequence's own pages, so they are allocated, shared
and freed with them). Its row at the sequence's last computed position (the last committed token
with the hidden state that chose it) predicts the first draft. Further drafts chain as DeepSeek-V3
and MiMo are served (vLLM, SGLang): draft j comes from layer j mod K one position further, fed
draft j - 1 and the previous MTP row's hidden state. Those rows are speculative: positions past
the committed ones, overwritten by the committed rows of later steps before anything reads them
(a query reads only positions at or before its own). Where a sequence has no page yet for them
they go to scratch pages past the pool, which only the drafter's caches have.

Drafts are greedy (argmax; under a grammar, the likeliest token it allows: drafter.DraftPicker);
verification (engine.py) decides what is committed, so drafts change speed only, never output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from helios.engine.request import EngineStats, FinishCause
from helios.engine.sequence import SchedulerOutput, Sequence
from helios.engine.speculation.drafter import DraftPicker

MTP_KIND = "mtp_draft"  # program kinds mtp_draft.0, mtp_draft.1, ... (one per MTP layer)
MTP_CACHE = "mtp_kv"  # the layout's extra caches the MTP programs write (ignition.models.mtp)


def mtp_kinds(programs) -> tuple[str, ...]:
    """The core's MTP program kinds in layer order (empty: it has none)."""
    kinds, layer = [], 0
    while f"{MTP_KIND}.{layer}" in programs:
        kinds.append(f"{MTP_KIND}.{layer}")
        layer += 1
    return tuple(kinds)


@dataclass(slots=True)
class DraftRows:
    """One program call's rows, grouped by sequence (the programs' paged-attention inputs)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    hidden: list[Tensor]  # [n, hidden] per group
    tables: list[list[int]]
    seq_lens: list[int]
    starts: list[int]

    @classmethod
    def empty(cls) -> DraftRows:
        return cls([], [], [], [], [], [], [0])

    def add(self, tokens: list[int], positions: range, table: list[int], hidden: Tensor, size: int) -> None:
        self.token_ids += tokens
        self.positions += positions
        self.slots += [table[p // size] * size + p % size for p in positions]
        self.hidden.append(hidden)
        self.tables.append(table)
        self.seq_lens.append(positions.stop)
        self.starts.append(self.starts[-1] + len(positions))

    def inputs(self, logits_rows: list[int], device: str) -> dict[str, Tensor]:
        """The step-program inputs of these rows (every program with a paged cache takes them)."""
        width = max(len(t) for t in self.tables)
        tables = torch.zeros((len(self.tables), width), dtype=torch.int32)
        for index, table in enumerate(self.tables):
            tables[index, : len(table)] = torch.tensor(table, dtype=torch.int32)
        inputs = {
            "token_ids": torch.tensor(self.token_ids, dtype=torch.int64),
            "positions": torch.tensor(self.positions, dtype=torch.int64),
            "slot_mapping": torch.tensor(self.slots, dtype=torch.int64),
            "block_tables": tables,
            "seq_lens": torch.tensor(self.seq_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(self.starts, dtype=torch.int32),
            "logits_indices": torch.tensor(logits_rows, dtype=torch.int64),
        }
        return {name: value.to(device) for name, value in inputs.items()}


class MtpDrafter:
    """Proposes each running sequence's next drafts from the core's MTP programs (see the module)."""

    name = "mtp"

    def __init__(
        self,
        executor,
        kinds: tuple[str, ...],
        cache_indexes: tuple[int, ...],
        page_tokens: int,
        scratch_per_seq: int,
        max_rows: int,
        stats: EngineStats,
    ) -> None:
        """cache_indexes: the MTP caches in the executor's list (widened by scratch pages there);
        max_rows: the most sequences one chain call takes (scratch_per_seq pages each)."""
        self.executor = executor
        self.programs = [executor.drafters[kind] for kind in kinds]
        self.page_tokens = page_tokens
        self.num_pages = executor.kv[cache_indexes[0]].shape[0]
        self.scratch_per_seq = scratch_per_seq
        self.max_rows = max_rows
        wide = {i: executor.widen(i, scratch_per_seq * max_rows) for i in cache_indexes}
        self.kv = [wide.get(i, t) for i, t in enumerate(executor.kv)]  # the drafter's view: scratch included
        self.stats = stats
        self._proposals: dict[int, tuple[int, ...]] = {}  # id(seq) -> drafts for its next round
        self.picker = DraftPicker()  # the engine gives it its mask hook

    # ------------------------------------------------------------------ LearnedDrafter
    def proposal(self, seq: Sequence) -> tuple[int, ...]:
        return self._proposals.get(id(seq), ())

    def forget(self, seq: Sequence) -> None:
        self._proposals.pop(id(seq), None)

    @property
    def num_tracked(self) -> int:
        return len(self._proposals)

    # ------------------------------------------------------------------ after a step
    def observe(
        self, plan: SchedulerOutput, hidden: dict[int, Tensor], tables: dict[int, list[int]], depths: dict[int, int]
    ) -> None:
        """After update_from_output: the committed MTP rows of every sequence the step computed
        (tables: page tables from before the update, for sequences it finished), then drafts
        for those in `depths` (id(seq) -> how many)."""
        self._proposals = {}
        size = self.page_tokens
        rows = DraftRows.empty()
        wanted: list[tuple[Sequence, int]] = []  # (seq, its last row in the call)
        for chunk in plan.chunks:
            states = hidden.get(id(chunk))
            if states is None:
                continue
            width = chunk.num_tokens + len(chunk.draft_ids)
            for seq in chunk.choices or (chunk.seq,):
                if seq.finish is FinishCause.ERROR or id(seq) not in tables:
                    continue
                last = min(chunk.start + width, len(seq.token_ids) - 1)  # rows p < last have t[p+1]
                first = chunk.start
                if seq is not chunk.seq:  # a child forked now: only its own copied page lacks the rows
                    first = min(max(first, (chunk.start + chunk.num_tokens) // size * size), last - 1)
                if first >= last:
                    continue
                span = range(first, last)
                rows.add(
                    seq.token_ids[first + 1 : last + 1],
                    span,
                    tables[id(seq)],
                    states[first - chunk.start : last - chunk.start],
                    size,
                )
                if id(seq) in depths:
                    wanted.append((seq, rows.starts[-1] - 1))
        if not rows.token_ids:
            return
        logits, out = self._call(0, rows, [row for _, row in wanted] or [rows.starts[-1] - 1])
        if not wanted:
            return
        picks = self.picker.pick(logits, [(seq, seq.constraint) for seq, _ in wanted])
        # [seq, its drafts, the MTP hidden state of its latest row, its scratch pages' first id, grammar state]
        chain = [
            [seq, [pick[0]], out[row : row + 1], self.num_pages + i * self.scratch_per_seq, pick[1]]
            for i, ((seq, row), pick) in enumerate(zip(wanted[: self.max_rows], picks))
            if pick is not None
        ]
        if chain:
            self._chain(chain, depths)
        for seq, tokens, _, _, _ in chain:
            self._proposals[id(seq)] = tuple(tokens)
            self.stats.draft_steps += len(tokens)
        for (seq, _), pick in zip(wanted[self.max_rows :], picks[self.max_rows :]):
            if pick is not None:
                self._proposals[id(seq)] = (pick[0],)
                self.stats.draft_steps += 1

    def _chain(self, chain: list[list], depths: dict[int, int]) -> None:
        """Extend each sequence's drafts to its depth: draft j + 1 from layer j mod K at position
        last + j (the committed rows ended at last), fed draft j and the previous row's MTP hidden
        state, its KV written into the sequence's page or, past its pages, its scratch pages."""
        size = self.page_tokens
        for step in range(1, max(depths[id(entry[0])] for entry in chain)):
            # a chain whose grammar allowed nothing more stopped growing (its drafts fell behind)
            group = [entry for entry in chain if depths[id(entry[0])] > step and len(entry[1]) == step]
            if not group:
                break
            rows = DraftRows.empty()
            for seq, tokens, state, scratch, _ in group:
                position = len(seq.token_ids) - 2 + step
                table = list(seq.pages)
                table += range(scratch, scratch + position // size + 1 - len(table))
                rows.add([tokens[-1]], range(position, position + 1), table, state, size)
            logits, out = self._call(step % len(self.programs), rows, list(range(len(group))))
            picks = self.picker.pick(logits, [(entry[0], entry[4]) for entry in group])
            for index, (entry, pick) in enumerate(zip(group, picks)):
                if pick is not None:
                    entry[1].append(pick[0])
                    entry[2], entry[4] = out[index : index + 1], pick[1]

    def _call(self, layer: int, rows: DraftRows, logits_rows: list[int]) -> tuple[Tensor, Tensor]:
        """Run MTP layer `layer` over the rows: (logits of logits_rows [R, V], every row's MTP hidden state)."""
        device = self.executor.device
        inputs = rows.inputs(logits_rows, device)
        inputs["hidden_states"] = torch.cat(rows.hidden).to(device)
        outputs = self.programs[layer](self.executor.weights, self.kv, **inputs)
        return outputs["logits"], outputs["hidden_states"]
