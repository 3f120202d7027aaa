"""Each core states its weight and compute precision in /v1/models' flare object and /api/show
(a bfloat16 core's logprobs differ from a float32 export's: users pick the export for scoring)."""

from __future__ import annotations

from types import SimpleNamespace

from helios.protocols.models import precision
from helios.protocols.ollama import discovery


def _manifest(weights: str, kv: str) -> SimpleNamespace:
    return SimpleNamespace(weights=SimpleNamespace(dtype=weights), kv=SimpleNamespace(dtype=kv), quantization=None)


def test_a_core_run_as_stored() -> None:
    stated = precision(_manifest("bfloat16", "bfloat16"), None)
    assert stated == {
        "weights": "bfloat16",
        "weights_in_memory": "bfloat16",
        "compute": "bfloat16",
        "kv_cache": "bfloat16",
        "accumulation": "float32",
        "logprobs": stated["logprobs"],
    }
    assert "float32 export" in stated["logprobs"]


def test_a_16_bit_core_run_upcast() -> None:
    stated = precision(_manifest("bfloat16", "bfloat16"), "bfloat16")
    assert stated["weights"] == "bfloat16" and stated["compute"] == stated["kv_cache"] == "float32"
    assert stated["weights_in_memory"] == "float32"


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


def test_a_quantized_core_states_its_level() -> None:
    check = SimpleNamespace(max_abs_logprob_diff=0.25, top1_agreement=0.97, perplexity=12.5, reference_perplexity=12.0)
    manifest = _manifest("bfloat16", "bfloat16")
    manifest.quantization = SimpleNamespace(level="int4-g32", self_check=check)
    native = precision(manifest, None, "int4-g32")
    assert (native["weights"], native["weights_in_memory"], native["compute"]) == ("int4-g32", "int4-g32", "bfloat16")
    assert "int4-g32" in native["logprobs"] and "0.25" in native["logprobs"] and "stored values" in native["logprobs"]
    dequantized = precision(manifest, None, "bfloat16")
    assert dequantized["weights"] == "int4-g32" and "rounded to bfloat16" in dequantized["logprobs"]
