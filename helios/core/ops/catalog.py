"""The flare:: op set a core's programs may call (core format v1), as a core manifest records it.

Each op is defined (schema, reference and fake kernels) by one module of this package:
write_kv, paged_attention: base; paged_attention_until: bidirectional; routed_experts: moe;
block_select, block_sparse_attention: block_sparse; indexer_topk, sparse_paged_attention: sparse;
dsv4_*: deepseek_v4; causal_conv1d: recurrent; mamba2_scan: mamba; gated_delta_rule: gated_delta;
sink_attention: sinks; kda, kpool_topk: glm5_next.
"""

from __future__ import annotations

OPS_NAMESPACE = "flare"
OPS_VERSION = 1
OP_NAMES = (
    "write_kv",
    "paged_attention",
    "routed_experts",
    "block_select",
    "block_sparse_attention",
    "indexer_topk",
    "sparse_paged_attention",
    "dsv4_pool",
    "dsv4_indexer_topk",
    "dsv4_attention",
    "causal_conv1d",
    "mamba2_scan",
    "gated_delta_rule",
    "sink_attention",
    "kda",
    "kpool_topk",
    "paged_attention_until",
)


def describe() -> dict[str, object]:
    """The op-set record a core manifest stores."""
    return {"namespace": OPS_NAMESPACE, "version": OPS_VERSION, "ops": list(OP_NAMES)}
