"""The per-step attention layout of flare::paged_attention, shared by every layer and by
flare::sink_attention: which rows decode, their tables or gather indices and masks, and the
prefill chunks with their pages. It is the same for every layer with the same sliding window,
so it is planned once per step and window and reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from helios.core.ops.attention import visible_keys
from helios.engine.kernels.memo import StepMemo


@dataclass(frozen=True, slots=True)
class Prefill:
    start: int
    end: int
    pages: Tensor  # [blocks] the sequence's pages in order, from the first one a query's window reaches
    kv_len: int  # history tokens gathered from `pages` (all of them without a window)
    visible: Tensor | None  # [end - start, kv_len] bool: gathered key j is visible to query i; None: plain causal


@dataclass(frozen=True, slots=True)
class Plan:
    """The per-step attention layout shared by every layer.

    History is gathered a whole page at a time (contiguous page_tokens x heads x dim
    blocks), which copies several times faster than gathering token by token.
    """

    decode_rows: Tensor | None  # [Bd] query rows of the decode sequences
    decode_tables: Tensor | None  # [Bd, max_blocks] int32: the decode sequences' block tables (native kernel)
    decode_lens: Tensor | None  # [Bd] int64 KV lengths (native kernel)
    decode_positions: Tensor | None  # [Bd] int64 query positions (native kernel)
    decode_pages: Tensor | None  # [Bd * blocks] page ids from each row's first page in its window, padded to `blocks`
    decode_mask: Tensor | None  # [Bd, 1, 1, blocks * page_tokens] bool: gathered slot j holds visible history
    prefills: tuple[Prefill, ...]
    identity: bool  # every row decodes, in order: the output needs no scatter


# One plan per window size: a model mixing sliding and global layers alternates between them
# within a step, and each layout stays valid for all layers of its kind.
_plans: dict[tuple[int, bool], StepMemo[Plan]] = {}  # (window, native in-place decode) -> the step's plan


def first_page(position: Tensor | int, window: int, page_tokens: int) -> Tensor | int:
    """The page holding the oldest key visible to a query at `position` (0 without a window)."""
    if window <= 0:
        return position * 0
    oldest = position - window + 1
    return (oldest.clamp(min=0) if isinstance(oldest, Tensor) else max(oldest, 0)) // page_tokens


def step_plan(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    page_tokens: int,
    window: int,
    in_place: bool = False,
) -> Plan:
    """This step's plan for the window (built by whichever layer or op asks first).

    in_place: decode rows are attended by the native kernel (a table, length and position
    per row), not through a padded gather (pages, mask). Prefill chunks, however short, stay
    on SDPA: a prompt's remainder after a cached prefix then rounds like the whole prompt did
    (on 16-bit cores a different kernel could part the answers at a near tie)."""

    def build() -> Plan:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        decoding = _decoding(block_tables, seq_lens, positions, starts, decode, page_tokens, window, in_place)
        prefills = _prefills(block_tables, positions, starts, lens, set(decode), page_tokens, window)
        identity = len(decode) == len(lens) and decode == list(range(len(lens))) and starts[-1] == len(decode)
        return Plan(*decoding, prefills, identity)

    memo = _plans.setdefault((window, in_place), StepMemo())
    return memo.get((block_tables, seq_lens, query_start_loc, positions), build)


def _decoding(
    block_tables: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    starts: list[int],
    decode: list[int],
    page_tokens: int,
    window: int,
    in_place: bool,
) -> tuple[Tensor | None, ...]:
    """Plan's decode fields (decode_rows through decode_mask) for the sequences `decode`."""
    decode_rows = decode_tables = decode_lens = decode_positions = decode_pages = decode_mask = None
    if decode:
        picked = torch.tensor(decode)
        decode_rows = torch.tensor([starts[i] for i in decode])
    if decode and in_place:
        decode_tables = block_tables[picked].contiguous()
        decode_lens, decode_positions = seq_lens[picked].long(), positions[decode_rows].long()
    elif decode:
        dlens, dpos = seq_lens[picked].long(), positions[decode_rows].long()
        first = first_page(dpos, window, page_tokens)  # [Bd]: pages before the window are not gathered
        blocks = int(((dlens - 1) // page_tokens - first).max()) + 1
        columns = (first[:, None] + torch.arange(blocks)[None, :]).clamp(max=block_tables.shape[1] - 1)
        decode_pages = block_tables[picked[:, None], columns].reshape(-1).long()
        key_pos = first[:, None] * page_tokens + torch.arange(blocks * page_tokens)[None, :]
        held = key_pos < dlens[:, None]
        if window > 0:
            held &= key_pos > dpos[:, None] - window
        decode_mask = held[:, None, None, :]
    return decode_rows, decode_tables, decode_lens, decode_positions, decode_pages, decode_mask


def _prefills(
    block_tables: Tensor,
    positions: Tensor,
    starts: list[int],
    lens: list[int],
    decode: set[int],
    page_tokens: int,
    window: int,
) -> tuple[Prefill, ...]:
    """Every sequence with queries that does not decode, as a chunk over its gathered pages."""
    prefills = []
    for i, kv_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if i in decode or end <= start:
            continue
        first_pos, last_pos = int(positions[start]), int(positions[end - 1])
        first = int(first_page(first_pos, window, page_tokens))
        pages = block_tables[i, first : -(-kv_len // page_tokens)].long()
        whole = (
            end - start == kv_len and first_pos == 0 and last_pos == kv_len - 1 and (window <= 0 or kv_len <= window)
        )
        key_pos = torch.arange(first * page_tokens, kv_len)
        visible = None if whole else visible_keys(key_pos, positions[start:end], window)
        prefills.append(Prefill(start, end, pages, kv_len - first * page_tokens, visible))
    return tuple(prefills)
