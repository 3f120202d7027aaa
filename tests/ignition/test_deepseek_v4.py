"""The deepseek_v4 family: a tiny DeepSeek-V4 checkpoint (sliding, CSA and HCA layers; window 8 <
16-token pages; CSA groups of 4 with an indexer keeping 3; HCA groups of 12, which straddle
pages, chunks and reused prefixes; hash-routed then top-k routed experts; 4 hyper-connection
streams) exported with the deepseek4 recipe and checked against transformers' own
DeepseekV4ForCausalLM: the reference forward, the exported programs, the engine (batching, prefix
reuse, forks and preemption over the per-position caches), and Chat / Messages / Responses
through the native V4 encoder with DeepSeek reasoning and DSML tool calls."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from helios.core import Core
from helios.core.manifest import ExtraCache, KvLayout
from helios.core.ops import deepseek_v4 as ops
from helios.core.program import SCORED_PREFILL, allocate_kv, run_prompt
from helios.engine import EngineConfig, build_engine
from helios.engine.kernels import deepseek_v4 as kernels_deepseek_v4
from helios.engine.kernels import registry as kernels
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from ignition.export import internal_weights
from ignition.models import deepseek_v4, deepseek_v4_config
from ignition.sources import open_source
from ignition.testmodel import _init, write_testmodel
from tests.ignition.family_checks import (
    ASK,
    DSML,
    DSML_CALL,
    GREEDY,
    LONG_PREAMBLE,
    RESULT,
    SHORT_TEXTS,
    TEXTS,
    check_generation_matches,
    hf_logprobs,
    hf_model,
    read_turn,
    served,
    tiny_fixtures,
    tool_result_turns,
)

CSA, HCA, SLIDING = deepseek_v4.CSA, deepseek_v4.HCA, deepseek_v4.SLIDING
LONG = TEXTS[0] + " " + TEXTS[3]


ARCHITECTURE = "DeepseekV4ForCausalLM"
# (tiny DeepSeek-V4 checkpoint, its core with prompt logprobs) and transformers' model of it, once per module.
tiny, reference = tiny_fixtures("deepseek_v4", "deepseek4", ARCHITECTURE, eager=False)


def test_core_records_the_family_and_its_caches(tiny: tuple[Path, Path]) -> None:
    m = Core.open(tiny[1]).manifest
    assert (m.model.family, m.recipe.name, m.recipe.template_source) == (
        "deepseek_v4",
        "deepseek4",
        "native:deepseek_v4",
    )
    assert (m.recipe.reasoning_syntax, m.recipe.tool_syntax) == ("deepseek", "deepseek_dsml_v4")
    assert m.kv.shared_kv and (m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim) == (4, 1, 32)
    # HCA layer 0 and CSA layers 1, 3: compressor state and entries; CSA also the indexer's.
    assert [(e.name, e.head_dim) for e in m.kv.extra] == [
        ("layers.0.compressor_state", 64),
        ("layers.0.compressed_kv", 32),
        ("layers.1.compressor_state", 128),
        ("layers.1.compressed_kv", 32),
        ("layers.1.indexer_state", 64),
        ("layers.1.indexer_keys", 16),
        ("layers.3.compressor_state", 128),
        ("layers.3.compressed_kv", 32),
        ("layers.3.indexer_state", 64),
        ("layers.3.indexer_keys", 16),
    ]
    assert {"dsv4_pool", "dsv4_indexer_topk", "dsv4_attention"} <= set(m.ops.ops)
    assert m.golden.max_abs_diff <= 1e-3


def test_logprobs_match_transformers(tiny: tuple[Path, Path], reference) -> None:
    """A prompt past the window, a page, several HCA groups and the indexer's top-k, prefilled whole,
    in chunks of 16 and 5, and token by token; prompt logprobs from the scored prefill."""
    kernels.register()  # helios' kernels (test_kernels_match_the_reference_ops checks them against the ops')
    core = Core.open(tiny[1])
    step, scored, weights, m = (
        core.load_program(),
        core.load_program(SCORED_PREFILL),
        core.load_weights(),
        core.manifest,
    )
    ids = core.tokenizer().encode(LONG).ids
    assert len(ids) > 3 * 12 and len(ids) > 2 * m.limits.page_tokens and len(ids) // 4 > 3
    expected = hf_logprobs(reference, ids)
    worst = 0.0
    for chunk in (None, 16, 5):
        got = run_prompt(step, weights, m.kv, m.limits.page_tokens, ids, chunk=chunk).logprobs
        worst = max(worst, float((got - expected).abs().max()))
    decoded = 40  # token-by-token steps through groups completing one at a time
    got = run_prompt(step, weights, m.kv, m.limits.page_tokens, ids[:decoded], chunk=1).logprobs
    worst = max(worst, float((got - expected[:decoded]).abs().max()))
    run = run_prompt(scored, weights, m.kv, m.limits.page_tokens, ids, chunk=16)
    targets = torch.tensor(ids[1:])
    prompt = expected[:-1].gather(1, targets[:, None])[:, 0]
    worst = max(worst, float((run.outputs["prompt_logprobs"][:-1] - prompt).abs().max()))
    print(f"max |Δ logprob| vs transformers: {worst:.3g}")
    assert worst <= 1e-3, worst


@pytest.mark.parametrize("text", ["Hi", TEXTS[2], LONG])
def test_engine_generation_matches_transformers(tiny: tuple[Path, Path], reference, text: str) -> None:
    """Greedy tokens through the engine (16-token chunks, then decode rows through helios' kernels):
    each one's logprob and top alternatives equal transformers' on the whole sequence."""
    check_generation_matches(tiny[1], reference, text, 24)


def _requests(core: Core, suffix: str = "", n: int = 1) -> list[EngineRequest]:
    tok = core.tokenizer()
    return [
        EngineRequest(f"r{i}{suffix}", tuple(tok.encode(LONG_PREAMBLE + t).ids), (GREEDY,) * n, 12, ignore_eos=True)
        for i, t in enumerate(SHORT_TEXTS)
    ]


def _tokens(outputs: dict) -> dict[str, list[int]]:
    return {rid: choices[0].token_ids for rid, choices in outputs.items()}


@pytest.fixture(scope="module")
def alone(tiny: tuple[Path, Path]) -> dict[str, list[int]]:
    """Each of the 8 prompts' greedy tokens, run one at a time without a prefix cache."""
    core = Core.open(tiny[1])
    solo = build_engine(core, EngineConfig(num_pages=128, enable_prefix_cache=False))
    out: dict[str, list[int]] = {}
    for request in _requests(core):
        out.update(_tokens(run_to_completion(solo, [request])))
    return out


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_engine_batching_invariance_and_prefix_reuse(tiny: tuple[Path, Path], alone, prefix_cache: bool) -> None:
    """8 prompts together == each alone, with 16-token prefill chunks, then again (from the prefix
    cache when on). Reused pages may end mid HCA group (16-token pages, groups of 12): the next
    chunk then pools that group partly from the reused pages' compressor state."""
    core = Core.open(tiny[1])
    engine = build_engine(core, EngineConfig(num_pages=128, prefill_chunk_size=16, enable_prefix_cache=prefix_cache))
    assert _tokens(run_to_completion(engine, _requests(core))) == alone
    again = run_to_completion(engine, _requests(core, "b"))
    assert {k[:-1]: v for k, v in _tokens(again).items()} == alone
    cached = [c[0].num_cached_tokens for c in again.values()]
    assert (sum(cached) > 0) == prefix_cache
    assert any(n % 12 for n in cached) == prefix_cache  # some reuse ends inside an HCA group


def test_engine_forks_and_preemption_keep_the_extra_caches(tiny: tuple[Path, Path], alone) -> None:
    """n = 2 choices fork after the prompt (the partial last page is copied, extra caches too), and a
    pool too small for every request preempts and recomputes: outputs equal the unbatched ones."""
    core = Core.open(tiny[1])
    forked = run_to_completion(build_engine(core, EngineConfig(num_pages=128)), _requests(core, n=2))
    assert {rid: [c.token_ids for c in choices] for rid, choices in forked.items()} == {
        r: [t, t] for r, t in alone.items()
    }
    small = build_engine(core, EngineConfig(num_pages=12, prefill_chunk_size=16))
    assert _tokens(run_to_completion(small, _requests(core))) == alone
    assert small.stats.preemptions > 0


def _random_step(seed: int):
    """Two sequences over shuffled 4-token pages: one prefilling positions 5..13, one decoding at 22."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[3, 7, 1, 9, 0, 0], [0, 2, 4, 5, 6, 8]], dtype=torch.int32)
    positions = torch.tensor([*range(5, 14), 22])
    return gen, tables, positions, torch.tensor([0, 9, 10], dtype=torch.int32)


@pytest.mark.parametrize(("rate", "overlap"), [(4, True), (3, False), (5, True)])
def test_kernels_match_the_reference_ops(rate: int, overlap: bool) -> None:
    """helios' per-sequence kernels == the one-query-at-a-time reference ops (groups straddling
    pages, partial windows, entries all or indexer-picked, with and without compressed entries)."""
    gen, tables, positions, starts = _random_step(rate)
    state = torch.randn(12, 4, 1, 32 if overlap else 16, generator=gen)
    pooled = ops.dsv4_pool(state, tables, starts, positions, rate, overlap)
    assert torch.equal(kernels_deepseek_v4.pool_cpu(state, tables, starts, positions, rate, overlap), pooled)
    done = (positions + 1) % rate == 0
    assert bool(pooled[done].abs().sum(-1).gt(0).all()) and not pooled[~done].any()
    keys, q, head_weights = (
        torch.randn(12, 4, 1, 16, generator=gen),
        torch.randn(10, 4, 16, generator=gen),
        torch.randn(10, 4, generator=gen),
    )
    picks = ops.dsv4_indexer_topk(q, head_weights, keys, tables, starts, positions, rate, 3, 0.25)
    assert torch.equal(
        kernels_deepseek_v4.indexer_topk_cpu(q, head_weights, keys, tables, starts, positions, rate, 3, 0.25), picks
    )
    ready = (positions + 1) // rate
    assert all(((row >= 0).sum() == min(3, n)) and (row < n).all() for row, n in zip(picks, ready.tolist()))
    rows, entries = torch.randn(12, 4, 1, 16, generator=gen), torch.randn(12, 4, 1, 16, generator=gen)
    query, sinks = torch.randn(10, 4, 16, generator=gen), torch.randn(4, generator=gen)
    for cache, selected in ((None, None), (entries, None), (entries, picks)):
        expected = ops.dsv4_attention(query, rows, cache, tables, starts, positions, sinks, 0.3, 6, rate, selected)
        got = kernels_deepseek_v4.attention_cpu(
            query, rows, cache, tables, starts, positions, sinks, 0.3, 6, rate, selected
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pages_count_every_cache(tiny: tuple[Path, Path]) -> None:
    core = Core.open(tiny[1])
    kv = core.manifest.kv
    per_token = 4 * 32 + sum(e.num_heads * e.head_dim * len(e.layers) for e in kv.extra)
    assert kv.token_elements == per_token
    engine = build_engine(core, EngineConfig(kv_memory_bytes=10 * per_token * 16 * 4))  # fp32, 16-token pages
    assert engine.stats.total_pages == 10
    caches = allocate_kv(kv, 3, 16)
    assert len(caches) == kv.num_caches == 4 + len(kv.extra)
    assert [tuple(t.shape) for t in caches] == [(3, 16, heads, dim) for heads, dim in kv.cache_shapes()]
    assert tuple(caches[4].shape) == (3, 16, 1, 64)


def test_old_manifest_without_extra_caches_loads() -> None:
    kv = msgspec.json.decode(
        b'{"num_layers": 2, "num_kv_heads": 1, "head_dim": 16, "dtype": "float32", "shared_kv": true}', type=KvLayout
    )
    assert kv.extra == () and kv.num_caches == 2 and kv.token_elements == 32


# ---------------------------------------------------------------------------- config variants

# Beside the default: transformers' legacy keys (per-layer compress_ratios with a rate override,
# num_hash_layers, qk_rope_head_dim, a flat YaRN rope_scaling that only the compressed layers
# take, with V4's attention_factor 1); and sigmoid routing, tied embeddings, 2 streams, 4 output
# groups, an indexer keeping 1, nested rope_parameters whose YaRN keeps its own mscale.
VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "legacy_yarn": {
        "layer_types": None,
        "compress_rates": None,
        "mlp_layer_types": None,
        "partial_rotary_factor": None,
        "compress_ratios": [4, 0, 128, 128, 0],
        "compress_rate_hca": 8,
        "num_hash_layers": 1,
        "qk_rope_head_dim": 16,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    },
    "sigmoid_tied_nested": {
        "scoring_func": "sigmoid",
        "tie_word_embeddings": True,
        "hc_mult": 2,
        "o_groups": 4,
        "index_topk": 1,
        "sliding_window": 5,
        "layer_types": [CSA, SLIDING, HCA, CSA],
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 80000.0,
                "partial_rotary_factor": 0.5,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
            },
        },
    },
}


def write_variant(out: Path, changes: dict[str, object], seed: int) -> Path:
    """A tiny deepseek_v4 checkpoint with `changes` applied to its config (None removes a key)."""
    write_testmodel("deepseek_v4", out, seed=seed)
    if not changes:
        return out
    config = json.loads((out / "config.json").read_text()) | changes
    config = {k: v for k, v in config.items() if v is not None}
    generator = torch.Generator().manual_seed(seed)
    shapes = deepseek_v4.hf_shapes(deepseek_v4.FAMILY.config_from_hf(config))
    tensors = {n: deepseek_v4.testmodel_init(n, s, generator) for n, s in shapes.items()}
    tensors = {n: _init(n, shapes[n], generator) if t is None else t for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


class _Eager:
    """The step program run eagerly (no export), called like a loaded Program."""

    def __init__(self, config: deepseek_v4.DeepseekV4Config) -> None:
        from helios.core.program import program_signature

        self.module = deepseek_v4.StepProgram(config, 0, False, scored=False)
        self.input_names = tuple(t.name for t in program_signature("step", 0, False)[0])

    def __call__(self, weights, kv, **inputs):
        with torch.inference_mode():
            logits, lse = self.module(weights, kv, *[inputs[n] for n in self.input_names])
        return {"logits": logits, "logsumexp": lse}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_reference_and_program_match_transformers(name: str, tmp_path: Path) -> None:
    """Config parsing, the plain reference and the step program (eager, 16- and 3-token chunks)
    against transformers, for each variant."""
    checkpoint = write_variant(tmp_path / name, VARIANTS[name], seed=7)
    source = open_source(str(checkpoint))
    config = deepseek_v4.FAMILY.config_from_hf(source.hf_config)
    model = hf_model(checkpoint, ARCHITECTURE, eager=False)
    assert list(model.config.layer_types) == list(config.layer_types)
    assert [t == "hash_moe" for t in model.config.mlp_layer_types] == list(config.hash_layers)
    ids = torch.randint(3, config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logprobs(model, ids)
    ours = torch.log_softmax(deepseek_v4.reference_logits(config, source.tensors, ids), dim=-1)
    assert float((ours - expected).abs().max()) <= 1e-4
    weights = internal_weights(deepseek_v4.FAMILY, source, config, torch.float32)
    layout = KvLayout(
        *deepseek_v4.FAMILY.kv_shape(config),
        "float32",
        shared_kv=True,
        extra=tuple(ExtraCache(*e) for e in deepseek_v4.extra_caches(config)),
    )
    for chunk in (16, 3):
        got = run_prompt(_Eager(config), weights, layout, 16, ids, chunk=chunk).logprobs  # type: ignore[arg-type]
        assert float((got - expected).abs().max()) <= 1e-3, chunk


def _original_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint under DeepSeek's own names (ORIGINAL_WEIGHT_MAP inverted), one tensor per expert."""
    from ignition.models.naming import rename

    inverse = {target: source for source, target in deepseek_v4_config.ORIGINAL_WEIGHT_MAP.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"], out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = (
                    gate,
                    up,
                )
        elif name.endswith("experts.down_proj"):
            out.update({f"layers.{layer}.ffn.experts.{e}.w2.weight": t[e] for e in range(t.shape[0])})
        else:
            internal = rename(name, deepseek_v4.FAMILY.weight_map)[0]  # type: ignore[index]
            pattern = inverse[internal.replace(f"layers.{layer}.", "layers.{}.", 1) if layer else internal]
            out[pattern.format(layer)] = t.contiguous()
    return out


def test_deepseek_checkpoint_names_read_like_transformers(tmp_path: Path) -> None:
    """A checkpoint saved under DeepSeek's names (as released): transformers' load-time renaming
    gives back every tensor unchanged, and export reads it into the same core weights."""
    import shutil

    checkpoint = write_testmodel("deepseek_v4", tmp_path / "hf", seed=2)
    original = tmp_path / "deepseek"
    shutil.copytree(checkpoint, original)
    hf = open_source(str(checkpoint))
    save_file(_original_names(hf.tensors), str(original / "model.safetensors"), metadata={"format": "pt"})
    theirs = hf_model(checkpoint, ARCHITECTURE, eager=False).state_dict()
    ours = hf_model(original, ARCHITECTURE, eager=False).state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    config = deepseek_v4.FAMILY.config_from_hf(hf.hf_config)
    plain = internal_weights(deepseek_v4.FAMILY, hf, config, torch.float32)
    renamed = internal_weights(deepseek_v4.FAMILY, open_source(str(original)), config, torch.float32)
    assert plain.keys() == renamed.keys() and all(torch.equal(plain[n], renamed[n]) for n in plain)
    assert plain["layers.0.tid2eid"].dtype == torch.int64  # integer tables are not cast
    ids = list(range(3, 40))  # the self-check's reference reads either naming
    same = deepseek_v4.reference_logits(config, open_source(str(original)).tensors, ids)
    assert torch.equal(same, deepseek_v4.reference_logits(config, hf.tensors, ids))


REFUSED = {
    "hidden_act": "gelu",
    "scoring_func": "softmax",
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_key_value_heads": 2,
    "attention_bias": True,
    "mlp_bias": True,
    "swiglu_limit": 0.0,
    "sliding_window": 0,
    "o_groups": 3,
    "rope_parameters": {"rope_type": "linear", "factor": 2.0},
    "layer_types": [SLIDING, "full_attention", SLIDING, SLIDING],
    "compress_rates": {CSA: 4},
    "mlp_layer_types": ["moe", "dense", "moe", "moe"],
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_variants_are_refused(field: str) -> None:
    config = deepseek_v4.testmodel_config(300) | {field: REFUSED[field]}
    with pytest.raises(ValueError, match=field.split("_")[0] if field == "rope_parameters" else field):
        deepseek_v4.FAMILY.config_from_hf(config)


# ---------------------------------------------------------------------------- chat round trips

ANSWER, THINK = "It is sunny.", "The user wants weather."
ARGUMENTS = {"city": "Paris", "days": 3}
OUTPUT = f"{THINK}</think>Checking.\n\n{DSML_CALL}"
FINAL = f"Done.</think>{ANSWER}"

# The tiny core served in process; the scripted model writes DeepSeek-V4 syntax.
app = served("tiny")


# route -> finish reason (or status) of the call turn, then of the final turn.
FINISH = {"chat": ("tool_calls", "stop"), "messages": ("tool_use", "end_turn"), "responses": ("completed", "completed")}


@pytest.mark.parametrize("route", sorted(FINISH))
def test_tool_call_round_trip(app, route: str) -> None:
    """The call turn (reasoning, text, a DSML call) and, with its result in the history, the final
    turn, through each protocol and the native V4 encoder."""
    reply, prompt, final, final_prompt = tool_result_turns(app, route, OUTPUT, FINAL)
    call_finish, final_finish = FINISH[route]
    assert read_turn(route, reply) == {
        "parts": ["reasoning", "text", "call"],
        "reasoning": THINK,
        "text": "Checking.",
        "calls": [("get_weather", ARGUMENTS)],
        "finish": call_finish,
    }
    assert read_turn(route, final) == {
        "parts": ["reasoning", "text"],
        "reasoning": "Done.",
        "text": ANSWER,
        "calls": [],
        "finish": final_finish,
    }
    assert RESULT in final_prompt
    if route == "chat":
        assert prompt.endswith(f"<｜User｜>{ASK}<｜Assistant｜><think>") and '"name": "get_weather"' in prompt
        assert f"<{DSML}invoke" in final_prompt
    else:
        assert "Paris" in final_prompt
