"""Each core states its weight and compute precision in /v1/models' flare object and /api/show
(a bfloat16 core's logprobs differ from a float32 export's: users pick the export for scoring)."""

from __future__ import annotations

from types import SimpleNamespace

from helios.protocols.models import precision
from helios.protocols.ollama import discovery


def _manifest(weights: str, kv: str) -> SimpleNamespace:
    return SimpleNamespace(weights=SimpleNamespace(dtype=weights), kv=SimpleNamespace(dtype=kv))


def test_a_core_run_as_stored() -> None:
    assert precision(_manifest("bfloat16", "bfloat16"), None) == {
        "weights": "bfloat16",
        "compute": "bfloat16",
        "kv_cache": "bfloat16",
        "accumulation": "float32",
    }


def test_a_16_bit_core_run_upcast() -> None:
    stated = precision(_manifest("bfloat16", "bfloat16"), "bfloat16")
    assert stated["weights"] == "bfloat16" and stated["compute"] == stated["kv_cache"] == "float32"


def test_show_carries_the_dtypes(tiny_core) -> None:
    from helios.core import Core
    from helios.protocols.models import identity

    manifest = Core.open(tiny_core).manifest
    stated = precision(manifest, None)
    info = discovery(identity(manifest, (), 0), manifest, 128, stated).model_info
    assert (info["flare.weights_dtype"], info["flare.compute_dtype"], info["flare.kv_cache_dtype"]) == (
        manifest.weights.dtype,
        manifest.weights.dtype,
        manifest.kv.dtype,
    )
