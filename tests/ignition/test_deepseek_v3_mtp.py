"""DeepSeek-V3's multi-token-prediction layer in the kimi_k3 family: a tiny checkpoint with one MTP
layer in DeepSeek-V3's layout (model.layers.3.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens} and a
full MLA + MoE decoder layer) exported as mtp_draft.0; the program against the family's
reference_mtp and an MTP assembled from transformers' DeepseekV3 modules; the main model's
logprobs unchanged by the MTP layer's presence. Engine drafting with it: tests/engine/test_learned_drafts.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.core.program import SCORED_PREFILL, run_prompt
from ignition.errors import SourceError
from ignition.export import ExportOptions, export_core, internal_weights
from ignition.models import deepseek_v3, mtp
from ignition.models.mtp import run_mtp_prompt
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

PAGE = 16
MTP_LAYER = "model.layers.3."  # num_hidden_layers = 3
TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The capital of France is",
)


def _export(checkpoint: Path, out: Path) -> Path:
    export_core(
        open_source(str(checkpoint)),
        load_recipe("kimi3"),
        ExportOptions(out=out, prompt_logprobs=True, page_tokens=PAGE),
    )
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The MTP checkpoint and its core, and the same checkpoint with num_nextn_predict_layers = 0
    (its MTP tensors still there, left out by export) and that core."""
    ckpt = write_testmodel(
        "kimi_k3", tmp_path_factory.mktemp("ckpt") / "tiny-kimi-mtp", seed=5, overrides={"num_nextn_predict_layers": 1}
    )
    plain = tmp_path_factory.mktemp("ckpt") / "tiny-kimi-mtp-off"
    shutil.copytree(ckpt, plain)
    config = json.loads((plain / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    (plain / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    cores = tmp_path_factory.mktemp("cores")
    return {
        "ckpt": ckpt,
        "core": _export(ckpt, cores / "mtp"),
        "plain_ckpt": plain,
        "plain_core": _export(plain, cores / "plain"),
    }


def _prompts(core: Core) -> list[list[int]]:
    tok = core.tokenizer()
    return [tok.encode(text, add_special_tokens=False).ids for text in TEXTS]


def test_core_records_the_mtp_program_and_its_cache(tiny: dict[str, Path]) -> None:
    c = deepseek_v3.FAMILY.config_from_hf(json.loads((tiny["ckpt"] / "config.json").read_text()))
    assert (c.num_layers, c.num_mtp_layers, c.is_moe(3)) == (3, 1, True)
    m = Core.open(tiny["core"]).manifest
    assert sorted(m.programs) == ["mtp_draft.0", "scored_prefill", "step"]
    assert [(e.name, e.layers, e.num_heads, e.head_dim) for e in m.kv.extra] == [("mtp_kv", (3,), 1, 32 + 8)]
    assert m.kv.num_caches == 4  # three latent caches, then the MTP layer's
    for kind in ("step", "scored_prefill", "mtp_draft.0"):
        assert m.programs[kind].outputs[-1].name == "hidden_states" and m.programs[kind].outputs[-1].shape == ("T", 64)
    plain = Core.open(tiny["plain_core"]).manifest
    assert sorted(plain.programs) == ["scored_prefill", "step"] and plain.kv.extra == ()
    assert all(o.name != "hidden_states" for o in plain.programs["step"].outputs)
    weights = Core.open(tiny["plain_core"]).load_weights()
    assert not any(name.startswith("layers.3.") for name in weights)  # ignored_tensor left them out
    assert m.decode_weight_bytes == plain.decode_weight_bytes  # a decode step reads no MTP weight


def test_main_logprobs_unchanged_by_the_mtp_layer(tiny: dict[str, Path]) -> None:
    """The step and scored prefill of the MTP core equal the plain core's and transformers' (which
    leaves model.layers.3.* unloaded); the step's hidden_states are transformers' final-normed ones."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny["ckpt"]), dtype=torch.float32).eval()
    core, plain = Core.open(tiny["core"]), Core.open(tiny["plain_core"])
    m, weights, plain_weights = core.manifest, core.load_weights(), plain.load_weights()
    worst_hf = worst_plain = 0.0
    for ids in _prompts(core):
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            hf_hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        for kind in ("step", SCORED_PREFILL):
            got = run_prompt(core.load_program(kind), weights, m.kv, PAGE, ids, chunk=PAGE)
            base = run_prompt(plain.load_program(kind), plain_weights, plain.manifest.kv, PAGE, ids, chunk=PAGE)
            worst_plain = max(worst_plain, float((got.logprobs - base.logprobs).abs().max()))
            worst_hf = max(worst_hf, float((got.logprobs - reference).abs().max()))
        assert float((got.outputs["hidden_states"] - hf_hidden).abs().max()) <= 1e-4
    print(f"max |Δ logprob| MTP core vs plain core: {worst_plain:.3g}, vs transformers: {worst_hf:.3g}")
    assert worst_plain <= 1e-5 and worst_hf <= 1e-3  # fp32 rounding only: the graphs differ by one output


def _transformers_mtp_block(checkpoint: Path, tensors: dict[str, torch.Tensor]):
    """The MTP layer's decoder block and shared_head.norm as a one-layer DeepseekV3Model (its one
    layer MoE, as layer 3 is), loaded with model.layers.3's weights (experts stacked as
    transformers keeps them): transformers' own MLA and MoE for the MTP layer, fed by inputs_embeds."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    config = DeepseekV3Config.from_pretrained(str(checkpoint), num_hidden_layers=1, first_k_dense_replace=0)
    config._attn_implementation = "eager"
    block = DeepseekV3Model(config).eval()
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    state = {
        "embed_tokens.weight": tensors[MTP_LAYER + "embed_tokens.weight"],
        "norm.weight": tensors[MTP_LAYER + "shared_head.norm.weight"],
    }
    for name, tensor in tensors.items():
        inner = name[len(MTP_LAYER) :]
        if name.startswith(MTP_LAYER) and not inner.startswith(own) and ".experts." not in inner:
            state["layers.0." + inner] = tensor
    experts = range(config.n_routed_experts)
    expert = MTP_LAYER + "mlp.experts.{}.{}.weight"
    state["layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors[expert.format(e, "gate_proj")], tensors[expert.format(e, "up_proj")]]) for e in experts]
    )
    state["layers.0.mlp.experts.down_proj"] = torch.stack([tensors[expert.format(e, "down_proj")] for e in experts])
    missing, unexpected = block.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in n for n in missing), (missing, unexpected)
    return block


def test_mtp_program_matches_references(tiny: dict[str, Path]) -> None:
    """mtp_draft.0 fed the step's own hidden_states: its logprobs and hidden states equal the
    family's reference_mtp (prefilled in 16-row chunks, and row by row past the first page), and
    reference_mtp equals an MTP built from transformers' DeepseekV3 modules."""
    core = Core.open(tiny["core"])
    m, weights = core.manifest, core.load_weights()
    checkpoint = open_source(str(tiny["ckpt"]))
    config, t = deepseek_v3.FAMILY.config_from_hf(checkpoint.hf_config), checkpoint.tensors
    ids = _prompts(core)[0]
    assert len(ids) > PAGE + 4
    hidden = run_prompt(core.load_program(), weights, m.kv, PAGE, ids, chunk=PAGE).outputs["hidden_states"]
    next_ids, rows = ids[1:], hidden[:-1]  # row t: the token after position t, the main hidden state at t
    logits, mtp_hidden = deepseek_v3.reference_mtp(config, t, 0, next_ids, rows)
    ours = torch.log_softmax(logits, dim=-1)
    # transformers' modules: eh_proj(cat(enorm(e), hnorm(h))) into its one-layer model, shared_head.head after its norm
    norm = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))  # noqa: E731
    embedded = t[MTP_LAYER + "embed_tokens.weight"][torch.tensor(next_ids)]
    joined = torch.cat(
        [norm(embedded, t[MTP_LAYER + "enorm.weight"]), norm(rows, t[MTP_LAYER + "hnorm.weight"])], dim=-1
    )
    with torch.no_grad():
        out = _transformers_mtp_block(tiny["ckpt"], t)(inputs_embeds=(joined @ t[MTP_LAYER + "eh_proj.weight"].T)[None])
    hf_mtp_hidden = out.last_hidden_state[0]
    theirs = torch.log_softmax(hf_mtp_hidden @ t[MTP_LAYER + "shared_head.head.weight"].T, dim=-1)
    versus_hf = float((ours - theirs).abs().max())
    print(f"max |Δ logprob| of reference_mtp vs the transformers-built MTP: {versus_hf:.3g}")
    assert versus_hf <= 1e-4 and float((mtp_hidden - hf_mtp_hidden).abs().max()) <= 1e-4
    program = core.load_program("mtp_draft.0")
    worst = worst_hidden = 0.0
    for chunk, count in ((PAGE, len(next_ids)), (1, PAGE + 4)):
        got = run_mtp_prompt(program, weights, m.kv, PAGE, next_ids[:count], rows[:count], chunk=chunk)
        worst = max(worst, float((got["logits"] - got["logsumexp"][:, None] - ours[:count]).abs().max()))
        worst = max(worst, float((got["top_logprobs"] - ours[:count].gather(1, got["top_ids"])).abs().max()))
        worst_hidden = max(worst_hidden, float((got["hidden_states"] - mtp_hidden[:count]).abs().max()))
    print(f"max |Δ logprob| of mtp_draft.0 vs reference_mtp: {worst:.3g} (hidden states {worst_hidden:.3g})")
    assert worst <= 1e-4 and worst_hidden <= 1e-4


def _eager_mtp_diff(checkpoint, config, tensors: dict[str, torch.Tensor], kv) -> float:
    """The MtpProgram module run eagerly (not exported) on `tensors` against reference_mtp on them."""
    weights = internal_weights(deepseek_v3.FAMILY, replace(checkpoint, tensors=tensors), config, torch.float32)
    ids = list(range(3, 3 + PAGE + 6))
    hidden = deepseek_v3.reference_forward(config, tensors, ids[:-1])[1]
    logits, _ = deepseek_v3.reference_mtp(config, tensors, 0, ids[1:], hidden)
    module, names = (
        deepseek_v3.MtpProgram(config, 0, 2),
        [spec.name for spec in mtp.signature(config.hidden_size, 2)[1]],
    )

    def program(*args, **inputs) -> dict[str, torch.Tensor]:  # the outputs named, as a saved program's
        return dict(zip(names, module(*args, **inputs), strict=True))

    got = run_mtp_prompt(program, weights, kv, PAGE, ids[1:], hidden, chunk=5)
    return float((got["logits"] - got["logsumexp"][:, None] - torch.log_softmax(logits, dim=-1)).abs().max())


def test_mtp_layer_without_its_own_head_and_embedding_uses_the_main_ones(tiny: dict[str, Path]) -> None:
    """Checkpoints that leave out the MTP layer's embed_tokens / shared_head.head (SGLang reads the
    main model's): program and reference both fall back to the main embedding and lm_head; a config
    promising an MTP layer the checkpoint lacks is a source error naming the field."""
    checkpoint = open_source(str(tiny["ckpt"]))
    config = deepseek_v3.FAMILY.config_from_hf(checkpoint.hf_config)
    kv = Core.open(tiny["core"]).manifest.kv
    own = {MTP_LAYER + "embed_tokens.weight", MTP_LAYER + "shared_head.head.weight"}
    shared = {n: v for n, v in checkpoint.tensors.items() if n not in own}
    assert _eager_mtp_diff(checkpoint, config, checkpoint.tensors, kv) <= 1e-4
    assert _eager_mtp_diff(checkpoint, config, shared, kv) <= 1e-4
    ids, hidden = [5, 6, 7], torch.randn(3, 64)
    with_own = deepseek_v3.reference_mtp(config, checkpoint.tensors, 0, ids, hidden)[0]
    assert not torch.allclose(with_own, deepseek_v3.reference_mtp(config, shared, 0, ids, hidden)[0])
    main = {n: v for n, v in checkpoint.tensors.items() if not n.startswith(MTP_LAYER)}
    weights = internal_weights(deepseek_v3.FAMILY, replace(checkpoint, tensors=main), config, torch.float32)
    with pytest.raises(SourceError, match="num_nextn_predict_layers"):
        deepseek_v3.extra_programs(config, 2, weights)


def test_dense_mtp_layer_where_the_config_says_so(tiny: dict[str, Path], tmp_path: Path) -> None:
    """first_k_dense_replace past the MTP layer's number makes its MLP dense (as every layer below
    it): fused like the main dense layers, and the program follows reference_mtp."""
    path = write_testmodel(
        "kimi_k3", tmp_path / "dense", seed=7, overrides={"num_nextn_predict_layers": 1, "first_k_dense_replace": 4}
    )
    checkpoint = open_source(str(path))
    config = deepseek_v3.FAMILY.config_from_hf(checkpoint.hf_config)
    assert not config.is_moe(3) and MTP_LAYER + "mlp.gate_proj.weight" in checkpoint.tensors
    weights = internal_weights(deepseek_v3.FAMILY, checkpoint, config, torch.float32)
    assert "layers.3.w_gate_up" in weights and "layers.3.w_router" not in weights
    kv = Core.open(tiny["core"]).manifest.kv  # the same cache layout: only the MLPs differ
    assert _eager_mtp_diff(checkpoint, config, checkpoint.tensors, kv) <= 1e-4


def test_testmodel_cli_writes_the_mtp_layer(tmp_path: Path) -> None:
    from safetensors import safe_open
    from support import run_cli

    done = run_cli("ignition", "testmodel", "kimi_k3", "--mtp-layers", "1", "--seed", "5", "--out", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp_own = {
        MTP_LAYER + n
        for n in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
        )
    }
    assert mtp_own <= names and MTP_LAYER + "self_attn.kv_b_proj.weight" in names
    assert MTP_LAYER + "mlp.experts.7.down_proj.weight" in names and not any(
        n.startswith("model.layers.4.") for n in names
    )


def test_an_mtp_copy_of_the_main_embedding_and_head_is_stored_once(tiny: dict[str, Path], tmp_path: Path) -> None:
    """DeepSeek-V3's release repeats the embedding and lm_head in its MTP layer: an exact copy is
    dropped at export (the program reads the main tensors); a copy that differs is kept."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "copied"
    shutil.copytree(tiny["ckpt"], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[MTP_LAYER + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[MTP_LAYER + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    copied = Core.open(_export(path, tmp_path / "core"))  # its export self-check passes on the main tensors
    names = set(copied.load_weights())
    assert "layers.3.embed" not in names and "layers.3.head" not in names and {"embed", "lm_head"} <= names
    assert "layers.3.embed" in Core.open(tiny["core"]).load_weights()  # the test checkpoint's own differ: kept
    config = deepseek_v3.FAMILY.config_from_hf(json.loads((path / "config.json").read_text()))
    ids = [(5 * t + 2) % config.vocab_size for t in range(20)]
    hidden = torch.randn(len(ids), config.hidden_size)
    got = run_mtp_prompt(
        copied.load_program("mtp_draft.0"), copied.load_weights(), copied.manifest.kv, PAGE, ids, hidden
    )
    expected = deepseek_v3.reference_mtp(config, tensors, 0, ids, hidden)[0]
    assert float((got["logits"] - got["logsumexp"][:, None] - torch.log_softmax(expected, -1)).abs().max()) <= 1e-4
