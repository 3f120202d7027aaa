"""The frame of every family's step program: the forward signature export traces
(helios.core.program.program_signature's inputs), its optional inputs taken apart by name into
`StepInputs`, and what each family's step does the same way around its layers (image rows into the
embeddings, the outputs). A family's program subclasses `StepModule` and writes `step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.core.ops.collectives import TENSOR_GROUP
from ignition.models.heads import step_outputs


class Paged(NamedTuple):
    """A step's addressing of one page pool, in the order the flare:: attention ops take it."""

    slot_mapping: Tensor  # [T] page * page_tokens + offset; -1 = padding
    block_tables: Tensor  # [B, M]
    seq_lens: Tensor  # [B] KV length after this step
    query_start_loc: Tensor  # [B+1]
    positions: Tensor  # [T]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One call's inputs; an optional one is None where the core does not take it."""

    token_ids: Tensor  # [T]
    logits_indices: Tensor  # [R] rows whose distributions are returned
    paged: Paged  # the main page pool
    window: Paged  # the window pool (window_slot_mapping, window_block_tables); `paged` where the core has none
    state_slots: Tensor | None  # [B] recurrent-state slot of each sequence (StepModule.stateful)
    logprob_ids: Tensor | None  # [R, K] explicit logprob token ids
    target_ids: Tensor | None  # [T] the next prompt token of each row (scored prefill)
    image_features: Tensor | None  # [I, hidden] fp32 (vision cores)
    image_rows: Tensor | None  # [I] the rows whose input embedding each feature row replaces; -1 unused
    attention_until: Tensor | None  # [T] the last key each row may see (bidirectional images)
    # [T, width] each row's row of a host-resident embedding table (StepModule.host_input), else None
    host_rows: Tensor | None = None

    @property
    def positions(self) -> Tensor:
        return self.paged.positions

    def pages(self, sliding: bool) -> Paged:
        """The addressing of a sliding layer's caches (the window pool's, where there is one) or a full layer's."""
        return self.window if sliding else self.paged

    @property
    def recurrent(self) -> tuple[Tensor, Tensor, Tensor]:
        """(state_slots, query_start_loc, positions): what the recurrent-state ops take."""
        assert self.state_slots is not None
        return self.state_slots, self.paged.query_start_loc, self.paged.positions


class StepModule(torch.nn.Module):
    """forward(weights, kv_cache, *inputs) per helios.core.program.program_signature -> `step`'s outputs.

    The optional inputs follow the fixed ones in program_signature's order (state_slots,
    window_slot_mapping and window_block_tables, logprob_token_ids, target_ids, image_features and
    image_rows, attention_until); which ones a core takes is the config's and the class's business:
    `stateful`, `windowed()`, `images()` and `bidirectional()`.
    """

    stateful = False  # recurrent-state families: state_slots comes first among the optional inputs
    multimodal = False  # families whose configs may carry a vision tower (`config.vision`)
    # Tensor-parallel ranks this program runs on (ignition.parallel sets it on a rank program traced
    # with the sharded config): its shards meet through flare::all_reduce / all_gather; 1 = no collective.
    tp = 1
    # The input fed with rows of a host-resident table (export --host-embeddings sets it; last among the
    # inputs, helios.core.program.program_signature's host_rows): StepInputs.host_rows. "": none.
    host_input = ""

    def __init__(self, config: Any, num_top: int, explicit_ids: bool, scored: bool) -> None:
        super().__init__()
        self.config = config
        self.num_top = num_top
        self.explicit_ids = explicit_ids
        self.scored = scored

    def windowed(self) -> bool:
        """Whether the sliding layers' caches are pooled apart (the family's window_pool) for this config."""
        return False

    def images(self) -> bool:
        """Whether the core takes image_features and image_rows (a config with a vision tower)."""
        return self.multimodal and self.config.vision is not None

    def bidirectional(self) -> bool:
        """Whether image tokens attend each other both ways (the step takes attention_until)."""
        return False

    def forward(
        self,
        weights,
        kv_cache,
        token_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        extra_1=None,
        extra_2=None,
        extra_3=None,
        extra_4=None,
        extra_5=None,
        extra_6=None,
        extra_7=None,
        extra_8=None,
    ):
        extra = [t for t in (extra_1, extra_2, extra_3, extra_4, extra_5, extra_6, extra_7, extra_8) if t is not None]
        host_rows = extra.pop(-1) if self.host_input else None
        state_slots = extra.pop(0) if self.stateful else None
        paged = Paged(slot_mapping, block_tables, seq_lens, query_start_loc, positions)
        window = Paged(extra.pop(0), extra.pop(0), seq_lens, query_start_loc, positions) if self.windowed() else paged
        until = extra.pop(-1) if self.bidirectional() else None
        features, rows = (extra.pop(-2), extra.pop(-1)) if self.images() else (None, None)
        logprob_ids = extra.pop(0) if self.explicit_ids else None
        target_ids = extra.pop(0) if self.scored else None
        inputs = StepInputs(
            token_ids,
            logits_indices,
            paged,
            window,
            state_slots,
            logprob_ids,
            target_ids,
            features,
            rows,
            until,
            host_rows,
        )
        return self.step(weights, kv_cache, inputs)

    def step(self, weights: dict[str, Tensor], kv_cache: list[Tensor], s: StepInputs) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def reduce(self, partial: Tensor) -> Tensor:
        """A row-parallel projection's partial sums added over the ranks (identity on one rank)."""
        return torch.ops.flare.all_reduce(partial, self.tp, TENSOR_GROUP) if self.tp > 1 else partial

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """A rank's vocabulary shard's logits [R, ceil(V / tp)] -> the full vocabulary's [R, V], rank
        order (the last shard's padding rows cut)."""
        return torch.ops.flare.all_gather(logits, 1, self.tp, TENSOR_GROUP)[:, : self.config.vocab_size]

    def embed_tokens(self, weights: dict[str, Tensor], token_ids: Tensor) -> Tensor:
        """Input embeddings [T, hidden] fp32. On tp ranks the table is the rank's vocabulary shard
        from `vocab_start` (a [1] int64 weight): rows outside it are zero, the sum over ranks whole."""
        table = weights["embed"]
        if self.tp == 1:
            return F.embedding(token_ids, table).float()
        local = token_ids - weights["vocab_start"]
        inside = (local >= 0) & (local < table.shape[0])
        rows = F.embedding(local.clamp(0, table.shape[0] - 1), table).float() * inside[:, None]
        return self.reduce(rows)

    def outputs(self, hidden: Tensor, weights: dict[str, Tensor], s: StepInputs, softcap: float = 0.0) -> tuple:
        """program_signature's outputs from the final-normed hidden states [T, hidden] in the core dtype
        (on tp ranks, over the gathered vocabulary: the same outputs as one rank's)."""
        tied = self.config.tie_word_embeddings
        gather = self.gather_vocab if self.tp > 1 else None
        return step_outputs(
            hidden, weights, tied, s.logits_indices, self.num_top, s.logprob_ids, s.target_ids, softcap, gather
        )


class StatefulStepModule(StepModule):
    """A StepModule whose cores carry recurrent state: state_slots [B] follows logits_indices (the
    first optional input, StepModule.forward's extra_1)."""

    stateful = True


def cached_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pages: Paged, scale: float, *options: Any
) -> Tensor:
    """Write this step's keys and values [T, kv_heads, D] at the pages' slots, then attend the queries
    [T, heads, D] over the cache (flare::paged_attention; `options`: its window and softcap), in the
    cache's dtype: -> [T, heads, D]."""
    kvt = k_cache.dtype
    torch.ops.flare.write_kv(k_cache, v_cache, k.to(kvt), v.to(kvt), pages.slot_mapping)
    return torch.ops.flare.paged_attention(
        q.to(kvt),
        k_cache,
        v_cache,
        pages.block_tables,
        pages.seq_lens,
        pages.query_start_loc,
        pages.positions,
        scale,
        *options,
    )


def embed_images(x: Tensor, s: StepInputs) -> Tensor:
    """x [T, hidden] fp32 with the image rows' input embeddings replaced by the image features (vision
    cores; rows of -1 land on a scratch row past the end and are dropped)."""
    if s.image_features is None or s.image_rows is None:
        return x
    total = x.shape[0]
    rows = torch.where(s.image_rows < 0, total, s.image_rows)
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_copy(0, rows, s.image_features.float())[:total]
