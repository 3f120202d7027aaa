"""ONNX fixtures: a tiny Llama core exported with --onnx (step and scored prefill), built once per
test run (conftest.py's tiny_cores, also across pytest-xdist workers) and shared by the export,
verify, serving and executor tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import TinyCores


@pytest.fixture(scope="session")
def onnx_core(tiny_cores: TinyCores) -> Path:
    return tiny_cores("llama", "smollm2", 0, prompt_logprobs=True, onnx=True)[1]
