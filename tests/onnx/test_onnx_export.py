"""`ignition export --onnx` and `ignition verify --onnx`: the ONNX renditions of the step programs
against the torch programs (float32: logprobs within 1e-4, top-k ids exact except at ties), the
files map covering them, a corrupted ONNX file failing verify, and the families without an ONNX
form refused at export with the op named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from support import TinyCores
from typer.testing import CliRunner

from helios.core import Core
from helios.core.onnx_program import OnnxProgram, OnnxUnavailable, load_onnx
from helios.core.program import SCORED_PREFILL, STEP, run_prompt
from ignition import onnx_export
from ignition.cli import app
from ignition.errors import UsageError
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

DATA = Path(__file__).resolve().parents[1] / "data"
SLOW = pytest.mark.skipif(not os.environ.get("FLARE_SLOW_TESTS"), reason="slow: set FLARE_SLOW_TESTS=1")


def test_export_lists_and_digests_the_onnx_files(onnx_core: Path) -> None:
    files = Core.open(onnx_core).manifest.files
    for name in ("onnx/onnx.json", "onnx/step.onnx", "onnx/scored_prefill.onnx", "onnx/weights.safetensors"):
        assert name in files
    record = json.loads((onnx_core / "onnx" / "onnx.json").read_text())
    assert record["opset"] >= 18 and set(record["programs"]) == {STEP, SCORED_PREFILL}
    # every paged cache is written, and returned as an output (ONNX has no aliasing)
    assert record["programs"][STEP]["updated_caches"] == list(range(Core.open(onnx_core).manifest.kv.num_caches))


def test_verify_onnx_passes_and_inspect_shows_it(onnx_core: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(onnx_core), "--onnx", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["ok"] is True
    shown = runner.invoke(app, ["inspect", str(onnx_core)])
    assert shown.exit_code == 0 and "onnx/step.onnx" in shown.output and "opset 18" in shown.output


def test_onnx_step_matches_the_torch_step_on_a_batch(onnx_core: Path) -> None:
    """Two sequences in one step (one prefilling, one decoding over its history), KV pool
    updated in place: the same logprobs, top ids and pages as the torch program."""
    core = Core.open(onnx_core)
    m = core.manifest
    weights = core.load_weights()
    torch_step = core.load_program(STEP)
    onnx_step = load_onnx(core.root, m.files, STEP, m.programs[STEP], threads=1)
    assert isinstance(onnx_step, OnnxProgram)
    from helios.core.program import allocate_kv

    page = m.limits.page_tokens
    pools = [allocate_kv(m.kv, 8, page), allocate_kv(m.kv, 8, page)]
    history = list(range(5, 5 + page + 3))  # the second sequence: a page and a bit, prefilled first
    first = {
        "token_ids": torch.tensor(history),
        "positions": torch.arange(len(history)),
        "slot_mapping": torch.tensor([(6 if p < page else 2) * page + p % page for p in range(len(history))]),
        "block_tables": torch.tensor([[6, 2]], dtype=torch.int32),
        "seq_lens": torch.tensor([len(history)], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, len(history)], dtype=torch.int32),
        "logits_indices": torch.tensor([len(history) - 1]),
        "logprob_token_ids": torch.tensor([[0, 7]]),
    }
    n = len(history)
    second = {
        "token_ids": torch.tensor([11, 12, 13, 40]),
        "positions": torch.tensor([0, 1, 2, n]),
        "slot_mapping": torch.tensor([3 * page, 3 * page + 1, 3 * page + 2, 2 * page + n % page]),
        "block_tables": torch.tensor([[3, 0], [6, 2]], dtype=torch.int32),
        "seq_lens": torch.tensor([3, n + 1], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32),
        "logits_indices": torch.tensor([2, 3]),
        "logprob_token_ids": torch.tensor([[1, 2], [3, 4]]),
    }
    for inputs in (first, second):
        expected = torch_step(weights, pools[0], **inputs)
        got = onnx_step(weights, pools[1], **inputs)
        for name, value in expected.items():
            if value.is_floating_point():
                assert float((value - got[name]).abs().max()) < 1e-4, name
            else:
                assert torch.equal(value, got[name]), name
    for a, b in zip(*pools, strict=True):
        assert float((a - b).abs().max()) < 1e-5  # the ONNX step wrote the same pages, in place
    assert onnx_step.copied_back == 0


def test_corrupted_onnx_file_fails_verify(onnx_core: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(onnx_core, broken)
    step = broken / "onnx" / "step.onnx"
    data = bytearray(step.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    step.write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["verify", str(broken), "--onnx"])
    assert result.exit_code == 4
    assert "onnx/step.onnx" in result.output and "re-export" in result.output
    # the file also fails to load on its own (past the checksums): a clear error naming the flag
    with pytest.raises(OnnxUnavailable, match="--onnx"):
        core = Core.open(broken, verify_checksums=False)
        load_onnx(core.root, core.manifest.files, STEP, core.manifest.programs[STEP])


def test_a_core_without_onnx_is_named_by_verify(tiny_cores: TinyCores) -> None:
    out = tiny_cores("llama", "smollm2", 4)[1]  # a plain core (the recipe tests' smollm2 one)
    result = CliRunner().invoke(app, ["verify", str(out), "--onnx"])
    assert result.exit_code == 4 and "--onnx" in result.output


def test_ops_without_an_onnx_form_are_refused_by_name() -> None:
    assert set(onnx_export.ONNX_FORMS) == {"write_kv", "paged_attention", "routed_experts"}

    class Program:  # the part of an ExportedProgram check_convertible reads
        class graph:  # noqa: N801
            nodes = [type("Node", (), {"op": "call_function", "target": torch.ops.flare.gated_delta_rule.default})()]

    with pytest.raises(UsageError, match="flare::gated_delta_rule"):
        onnx_export.check_convertible(Program(), STEP)  # type: ignore[arg-type]


def _family_core(tmp_path: Path, family: str, recipe: str, seed: int) -> Path:
    checkpoint = write_testmodel(family, tmp_path / "ckpt", seed=seed)
    out = tmp_path / family
    export_core(open_source(str(checkpoint)), load_recipe(recipe), ExportOptions(out=out, onnx=True))
    return out


@SLOW
@pytest.mark.parametrize(
    ("family", "recipe", "seed"),
    [
        ("qwen3", str(DATA / "tiny_qwen3.toml"), 1),
        ("qwen3_moe", str(DATA / "tiny_qwen3_moe.toml"), 5),
        ("kimi_k3", "kimi3", 1),  # multi-head latent attention (one shared cache per layer)
    ],
)
def test_families_export_and_verify_onnx(tmp_path: Path, family: str, recipe: str, seed: int) -> None:
    core = Core.open(_family_core(tmp_path, family, recipe, seed))
    assert onnx_export.verify(core) < 1e-4
    m = core.manifest
    program = load_onnx(core.root, m.files, STEP, m.programs[STEP], threads=1)
    prompt = list(range(3, 30))
    a = run_prompt(core.load_program(STEP), core.load_weights(), m.kv, m.limits.page_tokens, prompt, chunk=5)
    b = run_prompt(program, {}, m.kv, m.limits.page_tokens, prompt, chunk=5)
    assert float((a.logprobs - b.logprobs).abs().max()) < 1e-4
