"""Paged attention with learned sink logits over a packed key|value cache (MiMo-V2's attention).

`flare::sink_attention` is `flare::paged_attention` with two differences the MiMo-V2 family
needs and the plain op cannot express:

* keys and values live in ONE cache tensor per layer, each kv head's row holding the key
  (the query's head size Dk) followed by the value (Dv = row width - Dk, which may differ
  from Dk: MiMo's values are 128 wide against 192-wide keys);
* optional per-query-head sink logits (gpt-oss / MiMo `self_attn.sinks`): one extra logit
  per head joins each query's softmax and is dropped afterwards, so the visible keys' weights
  sum to less than one: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)).

The window is flare::paged_attention's: key j is visible to the query at position p iff
p - window < j <= p (0 = no window).
"""

from __future__ import annotations

import torch
from torch import Tensor

from helios.core.ops.attention import history, sequence_rows, visible_keys


@torch.library.custom_op("flare::sink_attention", mutates_args=())
def sink_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    window: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal (optionally windowed) attention of a flat batch of queries over a packed paged cache.

    q:               [num_tokens, num_heads, Dk]
    kv_cache:        [num_pages, page_tokens, num_kv_heads, Dk + Dv]: key then value per kv head,
                     already holding this step's rows (num_heads a multiple of num_kv_heads;
                     query head h reads kv head h // (num_heads // num_kv_heads))
    block_tables, seq_lens, query_start_loc, positions: as flare::paged_attention
    scale:           multiplies q . k
    window:          key j is visible iff position - window < j <= position; 0 = no window
    sinks:           [num_heads] fp32 sink logits (compared with the scaled scores), or None
    returns          [num_tokens, num_heads, Dv] in q's dtype
    """
    dk = q.shape[-1]
    dv = kv_cache.shape[-1] - dk
    out = q.new_zeros(q.shape[0], q.shape[1], dv)
    group = q.shape[1] // kv_cache.shape[2]
    for seq, start, end, kv_len in sequence_rows(query_start_loc, seq_lens):
        rows = history(kv_cache, block_tables[seq], kv_len).float()  # [S, KVH, Dk + Dv]
        keys = rows[..., :dk].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, Dk]
        values = rows[..., dk:].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, Dv]
        scores = (q[start:end].float().transpose(0, 1) @ keys.transpose(1, 2)) * scale  # [H, Tq, S]
        visible = visible_keys(torch.arange(kv_len, device=q.device), positions[start:end], window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.float()[:, None, None].expand(-1, end - start, 1)
            weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            weights = scores.softmax(dim=-1)
        out[start:end] = (weights @ values).transpose(0, 1).to(q.dtype)
    return out


@sink_attention.register_fake
def _sink_attention_fake(q, kv_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0, sinks=None):
    return q.new_empty(q.shape[0], q.shape[1], kv_cache.shape[-1] - q.shape[-1])
