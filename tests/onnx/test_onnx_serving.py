"""`[server] runtime = "onnxruntime"`: a core's ONNX renditions behind the same HTTP surface give
the torch runtime's greedy tokens and logprobs (float32: within 1e-4), for chat, completions and
prompt logprobs (the scored-prefill program); a core without them, or with a corrupted one, is a
startup error that says what to do."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient
from support import TinyCores

from helios.config import ConfigError, ServerConfig, load_config
from helios.core import CoreError
from helios.server.app import create_app
from helios.server.state import build_state

CHAT = {
    "model": "x",
    # Greedy is top_k 1: temperature 0 is clamped to the recipe's minimum (0.01) and still samples
    # with a fresh seed, so at this random model's near ties (8e-4 apart on "Tell me about the sea")
    # two runs could part whatever the runtime.
    "messages": [{"role": "user", "content": "Tell me about the sea"}],
    "max_tokens": 12,
    "temperature": 0,
    "top_k": 1,
    "logprobs": True,
    "top_logprobs": 5,
}
COMPLETION = {
    "model": "x",
    "prompt": "The capital of France is",
    "max_tokens": 12,
    "temperature": 0,
    "top_k": 1,
    "logprobs": 3,
    "echo": True,
}


def _settings(runtime: str) -> ServerConfig:
    return ServerConfig(kv_pages=64, serial_decode_rows=0, speculation="off", runtime=runtime)


@pytest.fixture(scope="module")
def answers(onnx_core: Path) -> Iterator[dict[str, dict[str, dict]]]:
    """runtime -> {"chat": body, "completion": body}, each runtime served in turn."""
    out: dict[str, dict[str, dict]] = {}
    for runtime in ("torch", "onnxruntime"):
        state = build_state(onnx_core, _settings(runtime))
        try:
            assert state.client.metrics().step_kind == ("onnxruntime" if runtime == "onnxruntime" else "portable")
            with TestClient(app=create_app(state)) as client:
                chat = client.post("/v1/chat/completions", json=CHAT)
                completion = client.post("/v1/completions", json=COMPLETION)
                assert chat.status_code == 200 and completion.status_code == 200, (chat.text, completion.text)
                out[runtime] = {"chat": chat.json(), "completion": completion.json()}
        finally:
            state.client.shutdown()
    yield out


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= 1e-4)


def test_chat_answers_alike(answers: dict[str, dict[str, dict]]) -> None:
    torch_choice, onnx_choice = (answers[r]["chat"]["choices"][0] for r in ("torch", "onnxruntime"))
    assert onnx_choice["message"]["content"] == torch_choice["message"]["content"]
    expected, got = torch_choice["logprobs"]["content"], onnx_choice["logprobs"]["content"]
    assert [t["token"] for t in got] == [t["token"] for t in expected]
    for a, b in zip(expected, got, strict=True):
        assert _close(a["logprob"], b["logprob"])
        assert [x["logprob"] for x in a["top_logprobs"]] == pytest.approx(
            [x["logprob"] for x in b["top_logprobs"]], abs=1e-4
        )


def test_completions_and_prompt_logprobs_answer_alike(answers: dict[str, dict[str, dict]]) -> None:
    torch_choice, onnx_choice = (answers[r]["completion"]["choices"][0] for r in ("torch", "onnxruntime"))
    assert onnx_choice["text"] == torch_choice["text"]
    expected, got = torch_choice["logprobs"], onnx_choice["logprobs"]
    assert got["tokens"] == expected["tokens"]  # the echoed prompt (scored prefill), then the generated tokens
    assert all(_close(a, b) for a, b in zip(expected["token_logprobs"], got["token_logprobs"], strict=True))


def test_a_core_without_onnx_is_a_startup_error_naming_the_flag(tiny_cores: TinyCores) -> None:
    plain = tiny_cores("llama", "smollm2", 4)[1]  # the recipe tests' smollm2 core
    with pytest.raises(CoreError, match="ignition export ... --onnx"):
        build_state(plain, _settings("onnxruntime"))


def test_a_corrupted_onnx_file_is_a_startup_error(onnx_core: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(onnx_core, broken)
    step = broken / "onnx" / "step.onnx"
    step.write_bytes(step.read_bytes()[:-100])
    with pytest.raises(CoreError, match=r"onnx/step\.onnx.*re-export"):
        build_state(broken, _settings("onnxruntime"))


def test_the_runtime_setting_is_checked(tmp_path: Path) -> None:
    config = tmp_path / "helios.toml"
    config.write_text('[server]\nruntime = "tensorrt"\n')
    with pytest.raises(ConfigError, match="runtime"):
        load_config(config)
    assert load_config(None, runtime="onnxruntime").runtime == "onnxruntime"
