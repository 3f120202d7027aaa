"""ONNX renditions of a core's vision and drafter programs: a tiny Kimi K3 core (multi-head latent
attention, routed MoE) with a vision tower and one MTP layer, exported with --onnx, renders every
program (step, vision, mtp_draft.0), `verify --onnx` checks each against its torch program, and
served on onnxruntime it holds no torch weights and answers as the torch runtime does: greedy
tokens with MTP drafts, an image chat's tokens (one seed: the recipe fixes temperature 1), logprobs
within 1e-4 (float32). The executor-level check
on the tiny Llama core (no torch weights, no torch programs) runs in CI; the Kimi core's export
takes minutes, so the rest needs FLARE_SLOW_TESTS=1."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from litestar.testing import TestClient

from helios.config import ServerConfig
from helios.core import Core
from helios.core.onnx_program import OnnxProgram
from helios.engine import EngineConfig, build_engine
from helios.engine.executor import Executor
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from helios.engine.speculation.drafter import SpeculationConfig
from helios.server.app import create_app
from helios.server.state import build_state
from ignition import onnx_export
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition.vision_cases import KIMI

SLOW = pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")
MTP = SpeculationConfig(mode="fixed", max_drafts=3, history=False)
DRAFT = "mtp_draft.0"


def test_the_onnxruntime_executor_loads_no_torch_weights_or_programs(onnx_core: Path) -> None:
    """The ONNX files hold their weights: the executor reads neither the core's weights file nor
    its torch programs (before, both were resident beside the ONNX sessions)."""
    executor = Executor(Core.open(onnx_core), 8, runtime="onnxruntime")
    assert executor.weights == {}
    assert isinstance(executor.step, OnnxProgram) and isinstance(executor.scored, OnnxProgram)
    assert executor.step_kind == "onnxruntime"


@pytest.mark.parametrize(("heads", "kv_heads", "causal"), [(2, 2, False), (4, 2, True)])
def test_the_attention_form_is_scaled_dot_product_attention(heads: int, kv_heads: int, causal: bool) -> None:
    """Vision towers' aten attention, which the exporter translates only at 4-d, as its ONNX form:
    3-d [heads, patches, dim] (the towers' shape) and 4-d grouped, with a boolean mask."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 7, 8, generator=generator)
    k, v = (torch.randn(1, kv_heads, 7, 8, generator=generator) for _ in range(2))
    mask = torch.rand(7, 7, generator=generator) > 0.3
    mask |= torch.eye(7, dtype=torch.bool)  # every row sees one key
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if causal else mask, is_causal=causal, enable_gqa=True
    )
    got = onnx_export.onnx_attention(q, k, v, None if causal else mask, is_causal=causal, enable_gqa=True)
    assert torch.allclose(got, expected, atol=1e-6)
    if heads == kv_heads:
        assert torch.allclose(
            onnx_export.onnx_attention(q[0], k[0], v[0]), F.scaled_dot_product_attention(q, k, v)[0], atol=1e-6
        )


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = write_testmodel(
        "kimi_k3",
        tmp_path_factory.mktemp("ckpt") / "tiny-kimi-vision-mtp",
        seed=3,
        vision=True,
        overrides={"num_nextn_predict_layers": 1},
    )
    out = tmp_path_factory.mktemp("cores") / "kimi-onnx"
    export_core(open_source(str(checkpoint)), load_recipe("kimi3"), ExportOptions(out=out, dtype="float32", onnx=True))
    return out


@SLOW
def test_vision_and_drafter_programs_are_rendered_and_verified(kimi: Path) -> None:
    core = Core.open(kimi)
    files = core.manifest.files
    for name in ("onnx/step.onnx", "onnx/vision.onnx", f"onnx/{DRAFT}.onnx"):
        assert name in files  # listed with its digest
    assert onnx_export.verify(core) < 1e-4


def _generate(core: Core, runtime: str, speculation: SpeculationConfig):
    tok = core.tokenizer()
    requests = [
        EngineRequest(f"r{i}", tuple(tok.encode(text).ids), (GREEDY,), 16, ignore_eos=True, num_top_logprobs=2)
        for i, text in enumerate(("the cat sat on the mat and the cat sat on the hat, " * 2, "One, two, three, four"))
    ]
    engine = build_engine(core, EngineConfig(num_pages=64, speculation=speculation, runtime=runtime))
    return run_to_completion(engine, requests), engine


@SLOW
def test_mtp_drafts_on_onnxruntime_answer_as_the_torch_runtime(kimi: Path) -> None:
    core = Core.open(kimi)
    expected, _ = _generate(core, "torch", MTP)
    got, engine = _generate(core, "onnxruntime", MTP)
    executor = engine.executor
    assert isinstance(executor.drafters[DRAFT], OnnxProgram) and executor.weights == {}
    assert engine.stats.draft_steps > 0  # the ONNX drafter proposed
    for key in expected:
        for a, b in zip(expected[key], got[key], strict=True):
            assert a.token_ids == b.token_ids
            assert all(abs(p.logprob - q.logprob) <= 1e-4 for p, q in zip(a.logprobs, b.logprobs, strict=True))


@SLOW
def test_an_image_chat_on_onnxruntime_answers_as_the_torch_runtime(kimi: Path) -> None:
    image = base64.b64encode(KIMI.encoded_images()[1]).decode()
    chat = {
        "model": "x",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image}"}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
        # The kimi3 recipe fixes temperature 1 and top_k -1 (no greedy through the API): one seed
        # draws the same tokens from the same distributions.
        "max_tokens": 8,
        "seed": 11,
        "logprobs": True,
        "top_logprobs": 3,
    }
    answers = {}
    for runtime in ("torch", "onnxruntime"):
        state = build_state(kimi, ServerConfig(kv_pages=64, serial_decode_rows=0, speculation="off", runtime=runtime))
        try:
            if runtime == "onnxruntime":
                executor = state.client.engine.executor  # type: ignore[attr-defined]
                assert isinstance(executor.vision, OnnxProgram) and isinstance(executor.step, OnnxProgram)
            with TestClient(app=create_app(state)) as client:
                response = client.post("/v1/chat/completions", json=chat)
                assert response.status_code == 200, response.text
                answers[runtime] = response.json()["choices"][0]
        finally:
            state.client.shutdown()
    expected, got = answers["torch"]["logprobs"]["content"], answers["onnxruntime"]["logprobs"]["content"]
    assert [t["token"] for t in got] == [t["token"] for t in expected]
    for a, b in zip(expected, got, strict=True):
        assert abs(a["logprob"] - b["logprob"]) <= 1e-4
        assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]]
        assert [x["logprob"] for x in a["top_logprobs"]] == pytest.approx(
            [x["logprob"] for x in b["top_logprobs"]], abs=1e-4
        )
