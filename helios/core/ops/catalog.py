"""The flare:: op set a core's programs may call, as a core manifest records it, and the module of
this package that defines each op (schema, reference and fake kernels).

OPS_VERSION is bumped whenever ops are added; helios refuses a core whose op set names an op it
does not define, or whose version is newer than its own (helios.core.bundle: `check_ops`).
Version 2 added the collectives (all_reduce, all_gather) of tensor-parallel rank programs."""

from __future__ import annotations

OPS_NAMESPACE = "flare"
OPS_VERSION = 2
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
    "all_reduce": "collectives",
    "all_gather": "collectives",
}
OP_NAMES = tuple(OPS)


def describe() -> dict[str, object]:
    """The op-set record a core manifest stores."""
    return {"namespace": OPS_NAMESPACE, "version": OPS_VERSION, "ops": list(OP_NAMES)}


def problem(namespace: str, version: int, ops: tuple[str, ...] | list[str]) -> str | None:
    """Why a core's recorded op set cannot run here (None: it can): another namespace, a newer
    op-set version, or ops this helios does not define."""
    if namespace != OPS_NAMESPACE:
        return f"its programs call ops of namespace {namespace!r}, not {OPS_NAMESPACE!r}"
    unknown = [op for op in ops if op not in OPS]
    if version > OPS_VERSION or unknown:
        named = f" ({', '.join(unknown)} unknown)" if unknown else ""
        return (
            f"its op set is version {version}{named}, newer than this Flare's ({OPS_VERSION}): upgrade Flare, "
            "or re-export the core with this version's `ignition export`"
        )
    return None
