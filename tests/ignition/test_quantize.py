"""ignition export --quantize: the stored layout round trip, which weights are quantized, the
manifest record and self-check figures of tiny llama / qwen3 / qwen3_moe cores at int8 and int4,
`ignition verify` on intact and corrupted scale tensors, and the options it refuses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import run_cli

from helios.core import Core, quant
from helios.core import manifest as mf
from helios.core.bundle import sha256_file
from helios.core.golden import recheck
from ignition import quantize
from ignition.errors import UsageError, VerifyError
from ignition.export import ExportOptions, check_options, export_core
from ignition.quant_check import check_stored
from ignition.quantize import EXPERTS, LINEAR, OTHER, QuantRequest, selected
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("group", quant.GROUPS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_round_trip(fmt: str, group: int, scale_dtype: torch.dtype) -> None:
    """Each value comes back within half a step of its group's grid, stacks of experts too."""
    w = torch.randn(3, 8, 256, generator=torch.Generator().manual_seed(group))
    w[0, 0, :group] = 0.0  # an all-zero group
    parts = quant.quantize(w, fmt, group, scale_dtype)
    back = quant.dequantize(parts[quant.QWEIGHT], parts[quant.SCALES], parts.get(quant.MINS), group)
    step = parts[quant.SCALES].float().repeat_interleave(group, -1)
    assert back.shape == w.shape and bool((back[0, 0, :group] == 0).all())
    slack = 0.51 if scale_dtype == torch.float32 else 0.6  # bf16 scales: the grid itself is rounded
    assert bool(((back - w).abs() <= step * slack + 1e-6).all())
    assert parts[quant.SCALES].dtype == scale_dtype and parts[quant.SCALES].shape == (3, 8, 256 // group)
    if fmt == quant.INT4:
        q = quant.unpack_int4(parts[quant.QWEIGHT])
        assert parts[quant.QWEIGHT].shape == (3, 8, 128) and torch.equal(quant.pack_int4(q), parts[quant.QWEIGHT])
    sizes = sum(t.numel() * t.element_size() for t in parts.values())
    assert sizes == quant.stored_bytes(tuple(w.shape), fmt, group, scale_dtype)


def test_selection_follows_the_programs_reads() -> None:
    """Linear weights and expert stacks are chosen; the vocabulary only when asked (a tied table
    under both flags); other reads, vision weights and odd input sizes stay float."""
    config = type("Config", (), {"vocab_size": 100})()
    weights = {
        "embed": torch.zeros(100, 64),
        "lm_head": torch.zeros(100, 64),
        "wqkv": torch.zeros(96, 64),
        "w_experts": torch.zeros(4, 64, 64),
        "w_odd": torch.zeros(64, 48),
        "norm": torch.zeros(64),
        "mixed": torch.zeros(64, 64),
        "tower": torch.zeros(64, 64),
    }
    uses = {
        "embed": {OTHER},
        "lm_head": {LINEAR},
        "wqkv": {LINEAR},
        "w_experts": {EXPERTS},
        "w_odd": {LINEAR},
        "norm": {OTHER},
        "mixed": {LINEAR, OTHER},
        "tower": {LINEAR},
    }
    chosen, kept = selected(QuantRequest("int4"), config, uses, weights, {"tower"})
    assert chosen == ["wqkv", "w_experts"] and kept == {"w_odd": 48}
    chosen, _ = selected(QuantRequest("int4", embeddings=True, head=True), config, uses, weights, set())
    assert chosen == ["embed", "lm_head", "wqkv", "w_experts", "tower"]
    tied = {**uses, "embed": {OTHER, LINEAR}}
    assert "embed" not in selected(QuantRequest("int8", head=True), config, tied, weights, set())[0]
    assert "embed" not in selected(QuantRequest("int8", embeddings=True), config, tied, weights, set())[0]
    assert "embed" in selected(QuantRequest("int8", embeddings=True, head=True), config, tied, weights, set())[0]


def test_refused_combinations(tmp_path: Path) -> None:
    base = ExportOptions(out=tmp_path / "core", quantization=QuantRequest("int4"))
    for options, flag in (
        (replace(base, tensor_parallel=(1, 2)), "--tensor-parallel"),
        (replace(base, host_embeddings=True), "--host-embeddings"),
        (replace(base, quantization=QuantRequest("int3")), "--quantize must be one of"),
        (replace(base, quantization=QuantRequest("int8", group=48)), "--quant-group"),
        (replace(base, quantization=QuantRequest("int8", scale_dtype="float8")), "--quant-scales"),
        (replace(base, quantization=QuantRequest("int8", activations="int16")), "--quant-activations"),
    ):
        with pytest.raises(UsageError, match=flag):
            check_options(options)


# family, checkpoint seed, recipe, request: each a tiny core exported once for this module
CASES = {
    "llama-int4": ("llama", 0, "smollm2", QuantRequest("int4")),
    "llama-int8": ("llama", 0, "smollm2", QuantRequest("int8", group=64, scale_dtype="bfloat16")),
    "qwen3-int8-g128": ("qwen3", 1, str(DATA / "tiny_qwen3.toml"), QuantRequest("int8", group=128)),
    "qwen3-int8-f16": ("qwen3", 1, str(DATA / "tiny_qwen3.toml"), QuantRequest("int8", scale_dtype="float16")),
    "qwen3_moe-int4": (
        "qwen3_moe",
        5,
        str(DATA / "tiny_qwen3_moe.toml"),
        QuantRequest("int4", embeddings=True, head=True),
    ),
}


@dataclass(frozen=True)
class Exported:
    core: Path  # quantized
    plain: Path  # the same checkpoint exported unquantized


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Exported]:
    """A case's cores, exported on first use (max_model_len 256 keeps the perplexity run short)."""
    made: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in made:
            family, seed, recipe, request = CASES[name]
            root = tmp_path_factory.mktemp(name)
            source = open_source(str(write_testmodel(family, root / "ckpt", seed=seed)))
            options = ExportOptions(out=root / "core", quantization=request, max_model_len=256)
            export_core(source, load_recipe(recipe), options)
            export_core(source, load_recipe(recipe), replace(options, out=root / "plain", quantization=None))
            made[name] = Exported(root / "core", root / "plain")
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_export(exported, name: str) -> None:
    cores = exported(name)
    family, _, _, request = CASES[name]
    core, plain = Core.open(cores.core), Core.open(cores.plain)
    m = core.manifest
    q = m.quantization
    assert q is not None and m.format.version == (4 if request.scale_dtype == "float16" else 3)  # the oldest it needs
    assert plain.manifest.format.version == 2 and plain.manifest.quantization is None  # unquantized: version 2
    stored = load_file(str(cores.core / "weights.safetensors"))
    float_weights = load_file(str(cores.plain / "weights.safetensors"))
    for weight, record in q.tensors.items():
        assert record.format == request.format and record.group == request.group and record.origin == "export"
        assert record.scale_dtype == request.scale_dtype and record.shape == tuple(float_weights[weight].shape)
        assert weight not in stored and set(quant.stored_names(weight, record.format)) <= set(stored)
        parts = quant.quantize(float_weights[weight], record.format, record.group, getattr(torch, record.scale_dtype))
        assert all(torch.equal(stored[weight + s], t) for s, t in parts.items())  # quant.py's layout, exactly
    names = set(q.tensors)
    if family == "qwen3_moe":  # expert stacks, and (both flags) the untied embedding and head
        assert {"layers.0.w_experts_gate_up", "layers.0.w_experts_down", "embed", "lm_head"} <= names
        assert "layers.0.w_router" not in names  # the router stays float
    else:
        assert "embed" not in names and "lm_head" not in names
    if name == "qwen3-int8-g128":  # only the MLP's down projection has 128 inputs
        assert names == {"layers.0.w_down", "layers.1.w_down"} and q.level == "int8-g128"
    check = q.self_check
    assert check is not None and check.prompts == 3 and check.positions == sum(len(p) for p in m.golden.prompts)
    assert 0.0 <= check.top1_agreement <= 1.0 and 0 < check.mean_abs_logprob_diff <= check.max_abs_logprob_diff
    assert check.perplexity_tokens == 256 and check.perplexity > 1 and check.reference_perplexity > 1
    assert m.decode_weight_bytes < plain.manifest.decode_weight_bytes
    check_stored(core)
    assert recheck(core) <= m.golden.tolerance  # golden values: the dequantized weights' run


def test_verify_catches_a_corrupted_scale(exported, tmp_path: Path) -> None:
    path = exported("llama-int4").core
    done = run_cli("ignition", "verify", str(path))
    assert done.returncode == 0, done.stderr
    shown = run_cli("ignition", "inspect", str(path))
    assert "precision   int4-g32: 8 weights (export)" in shown.stdout
    part = "layers.1.w_down" + quant.SCALES
    for change, message in (
        (lambda s: s.fill_(float("nan")), f"{part} holds non-finite values"),
        (lambda s: s.mul_(3.0), "golden prompt 0"),
        (lambda s: s.to(torch.bfloat16), f"{part} is bfloat16"),
    ):
        copy = tmp_path / f"core{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, copy)
        tensors = load_file(str(copy / "weights.safetensors"))
        changed = change(tensors[part].clone())
        tensors[part] = changed if changed is not None else tensors[part]
        save_file(tensors, str(copy / "weights.safetensors"))
        if message.endswith("non-finite values"):  # once: the digest catches any byte change
            done = run_cli("ignition", "verify", str(copy))
            assert done.returncode == 4 and "checksum mismatch" in done.stderr
        manifest = json.loads((copy / mf.MANIFEST_FILE).read_text())
        manifest["files"]["weights.safetensors"] = sha256_file(copy / "weights.safetensors")
        (copy / mf.MANIFEST_FILE).write_text(json.dumps(manifest))
        done = run_cli("ignition", "verify", str(copy))
        assert done.returncode == 4 and message in done.stderr, done.stderr
    with pytest.raises(VerifyError, match="non-finite"):
        bad = tmp_path / "core0"
        check_stored(Core.open(bad, verify_checksums=False))


def test_cli_flags_reach_the_export(tmp_path: Path) -> None:
    """The command line builds the request (refused here before any source is read)."""
    done = run_cli(
        "ignition", "export", str(tmp_path), "--recipe", "smollm2", "--out", str(tmp_path / "core"),
        "--quantize", "int4", "--quant-group", "64", "--host-embeddings",
    )  # fmt: skip
    assert done.returncode == 2 and "--quantize does not combine with --host-embeddings" in done.stderr
    done = run_cli(
        "ignition", "export", str(tmp_path), "-r", "smollm2", "-o", str(tmp_path / "c"), "--quantize", "int5"
    )
    assert done.returncode == 2 and "--quantize must be one of int8, int4" in done.stderr


def test_float16_scales_that_overflow_are_refused(tmp_path: Path) -> None:
    """A weight whose group scale passes float16's range is refused with what to do, not stored as inf."""
    family, seed, recipe, _ = CASES["qwen3-int8-f16"]
    checkpoint = write_testmodel(family, tmp_path / "ckpt", seed=seed)
    weights = load_file(str(next(checkpoint.glob("*.safetensors"))))
    big = next(name for name in weights if name.endswith("down_proj.weight"))
    weights[big] = weights[big] * 1e9
    save_file(weights, str(next(checkpoint.glob("*.safetensors"))))
    options = ExportOptions(out=tmp_path / "core", quantization=QuantRequest("int8", scale_dtype="float16"))
    with pytest.raises(UsageError, match="--quant-scales float32 or bfloat16"):
        export_core(open_source(str(checkpoint)), load_recipe(recipe), options)


def test_format_version_is_the_oldest_that_describes_the_core() -> None:
    """A compiled step holding int8-activation weights or calling the native top-k needs version 5
    (their blobs' layout and the op since then); without a compiled step, or with float
    activations and torch's top-k, a core keeps 2, 3 or 4."""

    def tensors(scale: str, activations: str) -> mf.Quantization:
        record = mf.QuantizedTensor("int4", 32, scale, (64, 64), "float32", activations=activations)
        return mf.Quantization("int4-g32", {"w": record})

    assert quantize.format_version(None, compiled=True) == 2
    assert quantize.format_version(None, compiled=True, native_topk=True) == 5  # its top-k op: native/topk.cpp
    assert quantize.format_version(None, native_topk=True) == 2
    assert quantize.format_version(tensors("float32", "float"), compiled=True) == 3
    assert quantize.format_version(tensors("float16", "float"), compiled=True) == 4
    assert quantize.format_version(tensors("float16", "int8")) == 4
    assert quantize.format_version(tensors("float32", "int8"), compiled=True) == 5
    assert quantize.format_version(tensors("float16", "int8"), compiled=True) == mf.FORMAT_VERSION == 5
