"""helios' CPU kernels for flare::paged_attention and flare::write_kv (the core's reference
kernels are correct but slow).

Decode rows (one query token per sequence) of a step are attended in place over their pages
by the native kernel (helios/engine/native), or, where it is not loaded, in one batched page
gather + SDPA over the padded page tables; prefill chunks use SDPA per sequence. The step's
layout is planned once per step and window (helios.engine.kernels.plan).

The native library, once loaded, holds these ops' CPU slot itself and hands what it does not
cover to the kernels here (register_fallbacks, which it calls): this module does not import it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import attend
from helios.engine.kernels.memo import StepMemo
from helios.engine.kernels.plan import step_plan

# Set by register_fallbacks, which the native library calls once it has loaded: decode rows then
# attend in place (flare_native::decode_attention) and write_kv copies natively.
_native = False


def _in_place(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the native kernel can attend this layer's decode rows."""
    return (
        _native
        and k_cache.shape[-1] <= 512
        and q.shape[-1] == k_cache.shape[-1]
        and k_cache.shape == v_cache.shape
        and k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0
) -> Tensor:
    """flare::paged_attention (arguments as its schema: helios.core.ops.base)."""
    page_tokens, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    in_place = _in_place(q, k_cache, v_cache)  # layers of one step may differ (head sizes, cache dtypes)
    plan = step_plan(block_tables, seq_lens, query_start_loc, positions, page_tokens, window, in_place)
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
        decoded = attend(query, keys, values, plan.decode_mask, scale, softcap)[:, :, 0]
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
        out[part.start : part.end] = attend(
            query[None], keys[None], values[None], part.visible, scale, softcap, causal=causal
        )[0].transpose(0, 1)
    return out


_padded_slots: StepMemo[bool] = StepMemo()


def write_kv_cpu(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Like the reference, without the boolean-mask copies when no slot is padding (checked
    once per step: every layer gets the same slot tensor); the native kernel copies rows
    straight into their slots, skipping padding itself."""
    if _native and k_cache.is_contiguous() and v_cache.is_contiguous():
        torch.ops.flare_native.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    padded = _padded_slots.get((slot_mapping,), lambda: bool(slot_mapping.numel()) and int(slot_mapping.min()) < 0)
    if padded:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_fallback: torch.library.Library | None = None


def register_fallbacks() -> None:
    """The kernels the native library hands what it does not cover (it calls this once loaded)."""
    global _fallback, _native
    _native = True
    if _fallback is None:
        _fallback = torch.library.Library("flare_fallback", "IMPL")  # kept alive: dropping it unregisters
        _fallback.impl("paged_attention", paged_attention_cpu, "CPU")
        _fallback.impl("write_kv", write_kv_cpu, "CPU")


def register(library: torch.library.Library) -> None:
    """Install these kernels into helios' flare IMPL library, unless the native library serves
    the ops' CPU slot (and falls back to these: register_fallbacks)."""
    if not _native:
        library.impl("paged_attention", paged_attention_cpu, "CPU")
        library.impl("write_kv", write_kv_cpu, "CPU")
