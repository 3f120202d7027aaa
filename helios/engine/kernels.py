"""helios' own kernels for the flare:: ops (the core's reference kernels are correct but slow).

CPU: decode rows (one query token per sequence) of a step are attended in one batched
page gather + SDPA over the padded page tables; prefill chunks use SDPA per sequence. The
step's layout (which rows decode, the gather indices, the masks) is the same for every
layer, so it is planned once per step and reused by all layers' calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

import helios.core.ops  # noqa: F401  (defines the ops before kernels are registered)

T = TypeVar("T")

_registered = False


@dataclass(frozen=True, slots=True)
class _Prefill:
    start: int
    end: int
    pages: Tensor  # [blocks] the sequence's pages, in order
    kv_len: int
    visible: Tensor | None  # [end - start, kv_len] bool: key j is visible to query i; None: plain causal


@dataclass(frozen=True, slots=True)
class _Plan:
    """The per-step attention layout shared by every layer.

    History is gathered a whole page at a time (contiguous page_tokens x heads x dim
    blocks), which copies several times faster than gathering token by token.
    """

    decode_rows: Tensor | None  # [Bd] query rows of the decode sequences
    decode_pages: Tensor | None  # [Bd * blocks] page ids, each row padded to `blocks`
    decode_mask: Tensor | None  # [Bd, 1, 1, blocks * page_tokens] bool: position j holds history
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
        if (self._value is not None and len(self._keys) == len(tensors)
                and all(ref() is t for ref, t in zip(self._keys, tensors))):  # fmt: skip
            return self._value
        self._value = build()
        self._keys = tuple(weakref.ref(t) for t in tensors)
        return self._value


_plans: _StepMemo[_Plan] = _StepMemo()


def _plan(block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, positions: Tensor, page_tokens: int) -> _Plan:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    decode_rows = decode_pages = decode_mask = None
    if decode:
        picked = torch.tensor(decode)
        dlens = seq_lens[picked].long()
        blocks = -(-int(dlens.max()) // page_tokens)
        decode_pages = block_tables[picked, :blocks].reshape(-1).long()
        decode_mask = (torch.arange(blocks * page_tokens)[None, :] < dlens[:, None])[:, None, None, :]
        decode_rows = torch.tensor([starts[i] for i in decode])
    decode_set = set(decode)
    prefills = []
    for i, kv_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if i in decode_set or end <= start:
            continue
        pages = block_tables[i, : -(-kv_len // page_tokens)].long()
        first = int(positions[start])
        whole = end - start == kv_len and first == 0 and int(positions[end - 1]) == kv_len - 1
        visible = None if whole else torch.arange(kv_len)[None, :] <= positions[start:end, None]
        prefills.append(_Prefill(start, end, pages, kv_len, visible))
    identity = len(decode) == len(lens) and decode == list(range(len(lens))) and starts[-1] == len(decode)
    return _Plan(decode_rows, decode_pages, decode_mask, tuple(prefills), identity)


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale):
    page_tokens, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    plan = _plans.get((block_tables, seq_lens, query_start_loc, positions),
                      lambda: _plan(block_tables, seq_lens, query_start_loc, positions, page_tokens))  # fmt: skip
    gqa = q.shape[1] != kv_heads
    decoded = None
    if plan.decode_pages is not None:
        # [Bd * blocks, P, KVH, D] -> [Bd, KVH, blocks * P, D] views; SDPA reads the strides as they are.
        rows = plan.decode_mask.shape[0]
        keys = k_cache.index_select(0, plan.decode_pages).view(rows, -1, kv_heads, dim).to(q.dtype).transpose(1, 2)
        values = v_cache.index_select(0, plan.decode_pages).view(rows, -1, kv_heads, dim).to(q.dtype).transpose(1, 2)
        query = (q if plan.identity else q[plan.decode_rows])[:, :, None, :]
        decoded = F.scaled_dot_product_attention(query, keys, values, attn_mask=plan.decode_mask, scale=scale,
                                                 enable_gqa=gqa)[:, :, 0]  # fmt: skip
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
        out[part.start : part.end] = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=part.visible, is_causal=causal, scale=scale, enable_gqa=gqa
        )[0].transpose(0, 1)
    return out


_padded_slots: _StepMemo[bool] = _StepMemo()


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Like the reference, without the boolean-mask copies when no slot is padding (checked
    once per step: every layer gets the same slot tensor)."""
    padded = _padded_slots.get((slot_mapping,), lambda: bool(slot_mapping.numel()) and int(slot_mapping.min()) < 0)
    if padded:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def register() -> None:
    """Install helios' CPU kernels (idempotent)."""
    global _registered
    if not _registered:
        torch.library.register_kernel("flare::paged_attention", "cpu", paged_attention_cpu)
        torch.library.register_kernel("flare::write_kv", "cpu", write_kv_cpu)
        _registered = True
