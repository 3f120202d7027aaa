"""ONNX fixtures: a tiny Llama core exported with --onnx (step and scored prefill), built once per
test session and shared by the export, verify and serving tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel


@pytest.fixture(scope="session")
def onnx_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("onnx")
    checkpoint = write_testmodel("llama", root / "ckpt", seed=0)
    out = root / "tiny-onnx"
    export_core(
        open_source(str(checkpoint)), load_recipe("smollm2"), ExportOptions(out=out, prompt_logprobs=True, onnx=True)
    )
    return out
