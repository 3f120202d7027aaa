"""ignition export/verify/inspect through the command line: outputs, determinism, bad inputs."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from support import run_cli

from helios.core import Core, CoreError, CoreFormatError
from helios.core import manifest as mf
from helios.engine import native
from ignition.errors import ExitCode
from ignition.testmodel import write_testmodel


def test_export_writes_a_complete_core(tiny_core: Path) -> None:
    core = Core.open(tiny_core)
    m = core.manifest
    # tiny_core is exported with --compile-step: the step is also built for this host.
    compiled = {f"programs/step.{platform.machine()}.aoti.so", f"programs/step.{platform.machine()}.aoti.json"}
    expected = {
        "core.json",
        "weights.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "golden.safetensors",
        "programs/step.pt2",
        "programs/scored_prefill.pt2",
        *compiled,
    }
    on_disk = {str(p.relative_to(tiny_core)) for p in tiny_core.rglob("*") if p.is_file()}
    assert on_disk == expected
    assert set(m.files) == expected - {"core.json"}
    # Its compiled step takes its top logprobs from flare_native::topk_rows (ignition.compiled.native_topk):
    # version 5, which an older helios refuses with a message instead of failing at the first step.
    topk = '"flare_native::topk_rows"' in (tiny_core / m.compiled["step"].file).with_suffix(".json").read_text()
    assert topk == native.loaded()
    assert (m.format.name, m.format.version) == ("flare-core", 5 if topk else 2) and mf.FORMAT_VERSION == 5
    assert m.capabilities == mf.Capabilities(
        max_top_logprobs=20, explicit_logprob_ids=True, prompt_logprobs=True, vision=False
    )
    assert m.tokenizer.eos_token_ids == (2,) and m.tokenizer.special_tokens["<|im_start|>"] == 1
    assert m.recipe.sampling.defaults.temperature == 0.2 and m.recipe.sampling.ranges["temperature"].min == 0.01
    assert m.golden.max_abs_diff <= m.golden.tolerance
    assert [t.name for t in m.programs["step"].outputs] == [
        "logits",
        "logsumexp",
        "top_logprobs",
        "top_ids",
        "explicit_logprobs",
    ]
    assert m.provenance.torch_version.startswith("2.13")
    assert set(m.compiled) == {"step"} and m.compiled["step"].file in compiled
    # The portable programs hold graphs only (the weights are stored once for them).
    assert (tiny_core / "programs/step.pt2").stat().st_size < (tiny_core / "weights.safetensors").stat().st_size


def test_same_source_exports_byte_identical_files(tiny_checkpoint: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        done = _export_smollm2(tiny_checkpoint, out, "--json")
        assert done.returncode == 0, done.stderr
    summaries = []
    for out in outs:
        files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
        summaries.append({str(f): (out / f).read_bytes() for f in files})
    a, b = summaries
    assert a.keys() == b.keys()
    for name in a:
        if name != "core.json":
            assert a[name] == b[name], f"{name} differs between two exports"
    ja, jb = json.loads(a["core.json"]), json.loads(b["core.json"])
    ja["provenance"].pop("exported_at"), jb["provenance"].pop("exported_at")
    assert ja == jb
    assert Core.open(outs[0]).digest == Core.open(outs[1]).digest


def test_json_summary_and_verify_and_inspect(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "core"
    flags = ("--json", "--alias", "tiny", "--alias", "tiny-2", "--max-top-logprobs", "5", "--no-logprob-ids")
    done = _export_smollm2(tiny_checkpoint, out, *flags, "--no-ranges")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["digest"] == Core.open(out).digest and summary["bytes"] > 0
    m = Core.open(out).manifest
    assert m.public_id == "tiny" and m.model.aliases == ("tiny", "tiny-2")
    assert m.capabilities.max_top_logprobs == 5 and not m.capabilities.explicit_logprob_ids
    assert "logprob_token_ids" not in [t.name for t in m.programs["step"].inputs]
    assert m.recipe.sampling.ranges == {}  # --no-ranges: every parameter fixed
    verified = run_cli("ignition", "verify", str(out), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"]
    shown = run_cli("ignition", "inspect", str(out), "--json")
    assert json.loads(shown.stdout)["model"]["aliases"] == ["tiny", "tiny-2"]
    assert "public id: tiny" in run_cli("ignition", "inspect", str(out)).stdout


def test_zero_top_logprobs_exports_no_alternatives(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = _export_smollm2(tiny_checkpoint, tmp_path / "c", "--max-top-logprobs", "0")
    assert done.returncode == 0, done.stderr
    outputs = [t.name for t in Core.open(tmp_path / "c").manifest.programs["step"].outputs]
    assert "top_logprobs" not in outputs and "explicit_logprobs" in outputs


# ------------------------------------------------------------------------------ bad inputs


def _export(*args: str):
    return run_cli("ignition", "export", *args)


def _export_smollm2(source: Path, out: Path, *flags: str):
    """`ignition export SOURCE --recipe smollm2 --out OUT FLAGS...`."""
    return _export(str(source), "--recipe", "smollm2", "--out", str(out), *flags)


def test_missing_source(tmp_path: Path) -> None:
    done = _export_smollm2(tmp_path / "nope.gguf", tmp_path / "o")
    assert done.returncode == ExitCode.SOURCE
    assert "does not exist" in done.stderr


def test_unknown_recipe(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = _export(str(tiny_checkpoint), "--recipe", "gpt9", "--out", str(tmp_path / "o"))
    assert done.returncode == ExitCode.USAGE
    assert "unknown recipe 'gpt9'" in done.stderr and "smollm2" in done.stderr


def test_unsupported_architecture(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # A recipe whose family ignition cannot compile (every shipped recipe's family may be compiled).
    recipe = tmp_path / "future.toml"
    recipe.write_text(
        'name = "future"\nfamily = "future_hybrid"\n[sampling]\ntemperature = 1.0\ntop_p = 1.0\ntop_k = -1\n'
    )
    done = _export(str(tiny_checkpoint), "--recipe", str(recipe), "--out", str(tmp_path / "o"))
    assert done.returncode == ExitCode.SOURCE and "family 'future_hybrid' is not supported" in done.stderr
    # A checkpoint whose architecture no family handles.
    ckpt = tmp_path / "odd"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(architectures=["FooForCausalLM"], model_type="foo")
    (ckpt / "config.json").write_text(json.dumps(config))
    done = _export_smollm2(ckpt, tmp_path / "o")
    assert done.returncode == ExitCode.SOURCE and "FooForCausalLM is not supported" in done.stderr


def test_corrupted_weight_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    done = _export_smollm2(ckpt, tmp_path / "o")
    assert done.returncode == ExitCode.SOURCE
    assert "model.safetensors: corrupted or unreadable" in done.stderr
    assert not (tmp_path / "o").exists()


def test_corrupted_gguf(tmp_path: Path, smollm2_gguf: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm2_gguf.read_bytes()[:5_000_000])
    done = _export_smollm2(broken, tmp_path / "o")
    assert done.returncode == ExitCode.SOURCE and "broken.gguf" in done.stderr


def test_max_top_logprobs_out_of_range(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = _export_smollm2(tiny_checkpoint, tmp_path / "o", "--max-top-logprobs", "21")
    assert done.returncode == ExitCode.USAGE and "--max-top-logprobs must be between 0 and 20" in done.stderr


def test_out_exists_needs_force(tiny_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    done = _export_smollm2(tiny_checkpoint, tmp_path / "o")
    assert done.returncode == ExitCode.USAGE and "--force" in done.stderr


def _copy_core(tiny_core: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "core"
    shutil.copytree(tiny_core, copy)
    return copy


def test_newer_format_version_is_refused(tiny_core: Path, tmp_path: Path) -> None:
    core = _copy_core(tiny_core, tmp_path)
    manifest = json.loads((core / "core.json").read_text())
    manifest["format"]["version"] = mf.FORMAT_VERSION + 1
    manifest["something_new"] = {"x": 1}
    (core / "core.json").write_text(json.dumps(manifest))
    done = run_cli("ignition", "verify", str(core))
    assert done.returncode == ExitCode.FORMAT
    assert f"format version {mf.FORMAT_VERSION + 1} is newer" in done.stderr and "re-export" in done.stderr
    with pytest.raises(CoreFormatError, match="upgrade Flare"):
        Core.open(core)


def test_verify_names_a_corrupted_file(tiny_core: Path, tmp_path: Path) -> None:
    core = _copy_core(tiny_core, tmp_path)
    weights = bytearray((core / "weights.safetensors").read_bytes())
    weights[-5] ^= 0xFF
    (core / "weights.safetensors").write_bytes(bytes(weights))
    done = run_cli("ignition", "verify", str(core))
    assert done.returncode == ExitCode.VERIFY and "weights.safetensors: checksum mismatch" in done.stderr
    with pytest.raises(CoreError, match="weights.safetensors"):
        Core.open(core)


def test_verify_names_a_golden_value_that_moved(tiny_core: Path, tmp_path: Path) -> None:
    """A golden file that no longer matches what the program computes (checksums updated)."""
    core = _copy_core(tiny_core, tmp_path)
    golden = load_file(str(core / "golden.safetensors"))
    golden["prompt_1"][3, 17] += 0.5
    save_file(golden, str(core / "golden.safetensors"))
    manifest = json.loads((core / "core.json").read_text())
    from helios.core.bundle import sha256_file

    manifest["files"]["golden.safetensors"] = sha256_file(core / "golden.safetensors")
    (core / "core.json").write_text(json.dumps(manifest))
    done = run_cli("ignition", "verify", str(core))
    assert done.returncode == ExitCode.VERIFY
    assert "golden prompt 1 position 3 token 17" in done.stderr


def test_testmodel_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = write_testmodel("llama", tmp_path / "a", seed=3)
    b = write_testmodel("llama", tmp_path / "b", seed=3)
    c = write_testmodel("llama", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    done = run_cli("ignition", "testmodel", "mamba", "--out", str(tmp_path / "m"))
    assert done.returncode == ExitCode.USAGE and "no test model for family 'mamba'" in done.stderr
