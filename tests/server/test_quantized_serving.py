"""A served quantized core (tests/quant_support.py builds them): the four protocols answer (with
logprobs where the protocol has them), the logprobs are those of the same core holding the
dequantized weights, a repeated prompt reuses its cached prefix, and discovery states the
precision (/v1/models' flare.precision, Ollama's details.quantization_level). Served on the
quantized kernels (the native library's, or the stand-in ops) and dequantized at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live import live_server
from quant_support import dequantized_core, export_quantized, qlinear_ops

from helios.config import ServerConfig
from helios.core import Core
from helios.engine import EngineConfig, build_engine, quantized
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from ignition.testmodel import write_testmodel

DATA = Path(__file__).resolve().parents[1] / "data"
RECIPES = {"llama": "smollm2", "qwen3_moe": str(DATA / "tiny_qwen3_moe.toml")}
# (family, format, path): both paths on the llama core, the quantized kernels on the MoE one.
SERVED = [("llama", "int4", "native"), ("llama", "int4", "fallback"), ("qwen3_moe", "int8", "native")]
PROMPT_IDS = list(range(30, 70))  # 40 tokens: two full pages of 16 to reuse
CHAT = [{"role": "user", "content": "Say something about the quantized weights, please."}]


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("served-quantized")
    found = {}
    for family, fmt, _ in SERVED:
        if (family, fmt) in found:
            continue
        checkpoint = write_testmodel(family, root / f"ckpt-{family}", seed=4)
        core = export_quantized(checkpoint, RECIPES[family], root / f"{family}-{fmt}", fmt)
        found[(family, fmt)] = (core, dequantized_core(core, root / f"{family}-{fmt}-twin"))
    return found


@pytest.fixture(scope="module", params=SERVED, ids=["-".join(case) for case in SERVED])
def served(request: pytest.FixtureRequest, cores: dict) -> Iterator[tuple[httpx.Client, str, Path, str]]:
    """(client, level, twin core, path) of one quantized core served in this process."""
    family, fmt, path = request.param
    core, twin = cores[(family, fmt)]
    with pytest.MonkeyPatch.context() as patch:
        if path == "native":
            try:
                qlinear_ops()
            except LookupError as exc:
                pytest.skip(str(exc))
        else:
            patch.setattr(quantized, "has_qlinear", lambda: False)
        with live_server(core, ServerConfig(kv_pages=128, host_cache=False)) as (url, state):
            loaded = state.client.engine.executor.quantized
            assert loaded is not None and bool(loaded.native) == (path == "native")
            with httpx.Client(base_url=url, timeout=120) as client:
                yield client, f"{fmt}-g32", twin, path


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_discovery_states_the_precision(served: tuple) -> None:
    client, level, _, path = served
    card = _ok(client.get("/v1/models"))["data"][0]
    stated = card["flare"]["precision"]
    assert stated["weights"] == level and stated["accumulation"] == "float32"
    assert stated["weights_in_memory"] == (level if path == "native" else "float32")
    assert level in stated["logprobs"] and "unquantized" in stated["logprobs"]
    shown = _ok(client.post("/api/show", json={"model": card["id"]}))
    assert shown["details"]["quantization_level"] == level
    assert shown["model_info"]["flare.weights_dtype"] == level
    assert _ok(client.get("/api/tags"))["models"][0]["details"]["quantization_level"] == level


def test_logprobs_equal_the_dequantized_twin(served: tuple) -> None:
    client, _, twin, _ = served
    body = {"model": "m", "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "top_k": 1, "logprobs": 2}
    choice = _ok(client.post("/v1/completions", json=body))["choices"][0]
    engine = build_engine(Core.open(twin), EngineConfig(num_pages=64))
    request = EngineRequest("t", tuple(PROMPT_IDS), (GREEDY,), 8, ignore_eos=True, num_top_logprobs=2)
    reference = run_to_completion(engine, [request])["t"][0]
    served_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(served_logprobs) == len(reference.logprobs) or choice["finish_reason"] == "stop"
    assert max(abs(a - b.logprob) for a, b in zip(served_logprobs, reference.logprobs)) < 1e-4
    again = _ok(client.post("/v1/completions", json=body))  # the prompt's pages now come from the cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert again["choices"][0]["logprobs"]["token_logprobs"] == served_logprobs


def test_the_four_protocols_answer(served: tuple) -> None:
    client, _, _, _ = served
    chat = _ok(
        client.post(
            "/v1/chat/completions",
            # seeded, and no end of text: a random tiny model's sampled answer could be empty
            json={
                "model": "m",
                "messages": CHAT,
                "max_tokens": 6,
                "logprobs": True,
                "top_logprobs": 2,
                "seed": 3,
                "ignore_eos": True,
            },
        )
    )
    entries = chat["choices"][0]["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)
    completion = _ok(
        client.post("/v1/completions", json={"model": "m", "prompt": "The", "max_tokens": 6, "logprobs": 1})
    )
    assert completion["choices"][0]["logprobs"]["token_logprobs"]
    responses = _ok(
        client.post(
            "/v1/responses",
            json={
                "model": "m",
                "input": "Say something.",
                "max_output_tokens": 6,
                "include": ["message.output_text.logprobs"],
                "top_logprobs": 2,
            },
        )
    )
    assert responses["status"] in ("completed", "incomplete") and responses["output"]
    messages = _ok(
        client.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 6, "messages": CHAT},
            headers={"anthropic-version": "2023-06-01"},
        )
    )
    assert messages["type"] == "message" and messages["usage"]["output_tokens"] > 0
