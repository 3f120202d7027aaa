"""The flare:: op set a core's programs may call (core format v1), as a core manifest records it,
and the module of this package that defines each op (schema, reference and fake kernels)."""

from __future__ import annotations

OPS_NAMESPACE = "flare"
OPS_VERSION = 1
# op name -> its defining module (helios.core.ops.<module>), in the order a manifest lists the ops
OPS = {
    "write_kv": "base",
    "paged_attention": "base",
    "routed_experts": "moe",
    "block_select": "block_sparse",
    "block_sparse_attention": "block_sparse",
    "indexer_topk": "sparse",
    "sparse_paged_attention": "sparse",
    "dsv4_pool": "deepseek_v4",
    "dsv4_indexer_topk": "deepseek_v4",
    "dsv4_attention": "deepseek_v4",
    "causal_conv1d": "recurrent",
    "mamba2_scan": "mamba",
    "gated_delta_rule": "gated_delta",
    "sink_attention": "sinks",
    "kda": "glm5_next",
    "kpool_topk": "glm5_next",
    "paged_attention_until": "bidirectional",
}
OP_NAMES = tuple(OPS)


def describe() -> dict[str, object]:
    """The op-set record a core manifest stores."""
    return {"namespace": OPS_NAMESPACE, "version": OPS_VERSION, "ops": list(OP_NAMES)}
