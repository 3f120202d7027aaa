"""helios' own kernels for the flare:: ops (the core's reference kernels are correct but slow).

CPU: decode rows (one query token per sequence) of a step are attended in place over their
pages by the native kernel (helios/engine/native), or, where it is not built, in one batched
page gather + SDPA over the padded page tables; prefill chunks use SDPA per sequence. The
step's layout (which rows decode, their tables, the gather indices, the masks) is the same for
every layer with the same sliding window, so it is planned once per step and window and reused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

import helios.core.ops  # defines the ops before kernels are registered; shares their masking and capped attention
from helios.engine import (
    kernels_gated_delta,
    kernels_glm5_next,
    kernels_mamba,
    kernels_moe,
    kernels_recurrent,
    kernels_sparse,
    native,
)

T = TypeVar("T")

_registered = False


@dataclass(frozen=True, slots=True)
class _Prefill:
    start: int
    end: int
    pages: Tensor  # [blocks] the sequence's pages in order, from the first one a query's window reaches
    kv_len: int  # history tokens gathered from `pages` (all of them without a window)
    visible: Tensor | None  # [end - start, kv_len] bool: gathered key j is visible to query i; None: plain causal


@dataclass(frozen=True, slots=True)
class _Plan:
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
    prefills: tuple[_Prefill, ...]
    identity: bool  # every row decodes, in order: the output needs no scatter


class _StepMemo(Generic[T]):
    """Remembers one value computed for the step whose input tensors are alive right now.

    Keyed by the identity of the step's input tensors: the executor creates them fresh
    every step, and a weak reference tells a dead step's tensor from a new one that
    happens to reuse its id.
    """

    def __init__(self) -> None:
        self._keys: tuple[weakref.ref, ...] = ()
        self._value: T | None = None

    def get(self, tensors: tuple[Tensor, ...], build: Callable[[], T]) -> T:
        if (
            self._value is not None
            and len(self._keys) == len(tensors)
            and all(ref() is t for ref, t in zip(self._keys, tensors))
        ):
            return self._value
        self._value = build()
        self._keys = tuple(weakref.ref(t) for t in tensors)
        return self._value


# One plan per window size: a model mixing sliding and global layers alternates between them
# within a step, and each layout stays valid for all layers of its kind.
_plans: dict[tuple[int, bool], _StepMemo[_Plan]] = {}  # (window, native in-place decode) -> the step's plan


def _first_page(position: Tensor | int, window: int, page_tokens: int) -> Tensor | int:
    """The page holding the oldest key visible to a query at `position` (0 without a window)."""
    if window <= 0:
        return position * 0
    oldest = position - window + 1
    return (oldest.clamp(min=0) if isinstance(oldest, Tensor) else max(oldest, 0)) // page_tokens


def _plan(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    page_tokens: int,
    window: int,
    in_place: bool = False,
) -> _Plan:
    """in_place: decode rows are attended by the native kernel (a table, length and position
    per row), not through a padded gather (pages, mask). Prefill chunks, however short, stay
    on SDPA: a prompt's remainder after a cached prefix then rounds like the whole prompt did
    (on 16-bit cores a different kernel could part the answers at a near tie)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    decode_rows = decode_tables = decode_lens = decode_positions = decode_pages = decode_mask = None
    if decode:
        picked = torch.tensor(decode)
        decode_rows = torch.tensor([starts[i] for i in decode])
    if decode and in_place:
        decode_tables = block_tables[picked].contiguous()
        decode_lens, decode_positions = seq_lens[picked].long(), positions[decode_rows].long()
    elif decode:
        dlens, dpos = seq_lens[picked].long(), positions[decode_rows].long()
        first = _first_page(dpos, window, page_tokens)  # [Bd]: pages before the window are not gathered
        blocks = int(((dlens - 1) // page_tokens - first).max()) + 1
        columns = (first[:, None] + torch.arange(blocks)[None, :]).clamp(max=block_tables.shape[1] - 1)
        decode_pages = block_tables[picked[:, None], columns].reshape(-1).long()
        key_pos = first[:, None] * page_tokens + torch.arange(blocks * page_tokens)[None, :]
        held = key_pos < dlens[:, None]
        if window > 0:
            held &= key_pos > dpos[:, None] - window
        decode_mask = held[:, None, None, :]
    decode_set = set(decode)
    prefills = []
    for i, kv_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if i in decode_set or end <= start:
            continue
        first_pos, last_pos = int(positions[start]), int(positions[end - 1])
        first = int(_first_page(first_pos, window, page_tokens))
        pages = block_tables[i, first : -(-kv_len // page_tokens)].long()
        whole = (
            end - start == kv_len and first_pos == 0 and last_pos == kv_len - 1 and (window <= 0 or kv_len <= window)
        )
        key_pos = torch.arange(first * page_tokens, kv_len)
        visible = None if whole else helios.core.ops.visible_keys(key_pos, positions[start:end], window)
        prefills.append(_Prefill(start, end, pages, kv_len - first * page_tokens, visible))
    identity = len(decode) == len(lens) and decode == list(range(len(lens))) and starts[-1] == len(decode)
    return _Plan(
        decode_rows, decode_tables, decode_lens, decode_positions, decode_pages, decode_mask, tuple(prefills), identity
    )


def _in_place(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the native kernel can attend this layer's decode rows."""
    return (
        native.loaded()
        and k_cache.shape[-1] <= 512
        and q.shape[-1] == k_cache.shape[-1]
        and k_cache.shape == v_cache.shape
        and k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0
):
    page_tokens, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    in_place = _in_place(q, k_cache, v_cache)  # layers of one step may differ (head sizes, cache dtypes)
    memo = _plans.setdefault((window, in_place), _StepMemo())
    plan = memo.get(
        (block_tables, seq_lens, query_start_loc, positions),
        lambda: _plan(block_tables, seq_lens, query_start_loc, positions, page_tokens, window, in_place),
    )
    decoded = None
    if plan.decode_tables is not None:
        query = q if plan.identity else q[plan.decode_rows]
        decoded = torch.ops.flare_native.decode_attention(
            query, k_cache, v_cache, plan.decode_tables, plan.decode_lens, plan.decode_positions, scale, window, softcap
        )
        if plan.identity:
            return decoded
    elif plan.decode_pages is not None:
        # [Bd * blocks, P, KVH, D] -> [Bd, KVH, blocks * P, D] views; SDPA reads the strides as they are.
        rows = plan.decode_mask.shape[0]
        keys = k_cache.index_select(0, plan.decode_pages).view(rows, -1, kv_heads, dim).to(q.dtype).transpose(1, 2)
        values = v_cache.index_select(0, plan.decode_pages).view(rows, -1, kv_heads, dim).to(q.dtype).transpose(1, 2)
        query = (q if plan.identity else q[plan.decode_rows])[:, :, None, :]
        decoded = helios.core.ops.attend(query, keys, values, plan.decode_mask, scale, softcap)[:, :, 0]
        if plan.identity:
            return decoded
    out = torch.empty_like(q)
    if decoded is not None:
        out[plan.decode_rows] = decoded
    for part in plan.prefills:
        keys = k_cache.index_select(0, part.pages).view(-1, kv_heads, dim)[: part.kv_len].transpose(0, 1).to(q.dtype)
        values = v_cache.index_select(0, part.pages).view(-1, kv_heads, dim)[: part.kv_len].transpose(0, 1).to(q.dtype)
        query = q[part.start : part.end].transpose(0, 1)  # [H, Tq, D] against [KVH, Tk, D]
        # 4-D with a batch of one: the CPU flash kernel (3-D inputs fall back to the math path).
        # A chunk holding the whole history is plainly causal, which lets the kernel skip the
        # masked half instead of computing it under an explicit mask.
        causal = part.visible is None
        out[part.start : part.end] = helios.core.ops.attend(
            query[None], keys[None], values[None], part.visible, scale, softcap, causal=causal
        )[0].transpose(0, 1)
    return out


_plain_until: _StepMemo[bool] = _StepMemo()


def paged_attention_until_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, until, scale, window=0, softcap=0.0
):
    """flare::paged_attention_until: a step whose every query ends at its own position (decode steps,
    chunks without image tokens) is plain paged attention (the fast kernels, checked once per step);
    one with image tokens attends under the explicit mask of the reference."""
    plain = _plain_until.get((positions, until), lambda: bool(torch.equal(positions, until)))
    if plain:
        return torch.ops.flare.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window, softcap
        )
    return helios.core.ops_bidirectional.reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, until, scale, window, softcap
    )


_padded_slots: _StepMemo[bool] = _StepMemo()


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Like the reference, without the boolean-mask copies when no slot is padding (checked
    once per step: every layer gets the same slot tensor); the native kernel copies rows
    straight into their slots, skipping padding itself."""
    if native.loaded() and k_cache.is_contiguous() and v_cache.is_contiguous():
        torch.ops.flare_native.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    padded = _padded_slots.get((slot_mapping,), lambda: bool(slot_mapping.numel()) and int(slot_mapping.min()) < 0)
    if padded:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_library: torch.library.Library | None = None
_fallback: torch.library.Library | None = None


def register_fallbacks() -> None:
    """The kernels the native library hands what it does not cover (called once it is loaded)."""
    global _fallback
    if _fallback is None:
        _fallback = torch.library.Library("flare_fallback", "IMPL")  # kept alive: dropping it unregisters
        _fallback.impl("paged_attention", paged_attention_cpu, "CPU")
        _fallback.impl("write_kv", write_kv_cpu, "CPU")


def register() -> None:
    """Install helios' CPU kernels (idempotent).

    They go straight into the dispatcher's CPU slot rather than through
    torch.library.register_kernel, whose wrapper imports torch._dynamo on its first call
    (over a second, paid by the first request of a compiled step) and costs microseconds on
    every call. The portable programs call the kernels directly anyway (graph.simplify); the
    compiled step reaches them through the dispatcher. Where the native library loads, it
    holds the CPU slot of flare::paged_attention and flare::write_kv itself (a decode step then
    runs without the GIL) and hands the steps it does not cover to the kernels here.
    """
    global _registered, _library
    if not _registered:
        native.load()  # before any step runs, so every step of this process uses the same kernels
        _library = torch.library.Library("flare", "IMPL")  # kept alive: dropping it unregisters
        if not native.loaded():  # else the native library serves them (and falls back to these: native.load)
            _library.impl("paged_attention", paged_attention_cpu, "CPU")
            _library.impl("write_kv", write_kv_cpu, "CPU")
        _library.impl("routed_experts", kernels_moe.routed_experts_cpu, "CPU")
        _library.impl("paged_attention_until", paged_attention_until_cpu, "CPU")
        from helios.engine import kernels_block_sparse  # imports this module (its step memo)

        _library.impl("block_select", kernels_block_sparse.block_select_cpu, "CPU")
        _library.impl("block_sparse_attention", kernels_block_sparse.block_sparse_attention_cpu, "CPU")
        kernels_sparse.register(_library)
        from helios.engine import kernels_deepseek_v4  # here: it builds on this module's _StepMemo

        kernels_deepseek_v4.register(_library)
        kernels_recurrent.register(_library)
        kernels_mamba.register(_library)
        kernels_gated_delta.register(_library)
        kernels_glm5_next.register(_library)
        from helios.engine import kernels_sinks  # builds on this module's step plans

        kernels_sinks.register(_library)
        _registered = True
