"""A separate draft core proposing drafts (helios.engine.speculation.draft_core) for tiny Llama cores of one
tokenizer: the target drafting for itself has every greedy draft accepted (its draft KV, chained
rows and scratch pages are exact), another seed's core drafts losslessly (n = 2, a token stop,
preemption under a small pool, cancellation) and leaves nothing behind, /metrics names it, and
a core of another tokenizer is refused with a message saying so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from support import TinyCores

from helios.config import ConfigError, ServerConfig, load_config
from helios.core import Core
from helios.engine import EngineConfig, build_engine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest, FinishCause
from helios.engine.sampling_params import GREEDY, SamplingParams
from helios.engine.speculation.draft_core import incompatibility
from helios.engine.speculation.drafter import SpeculationConfig
from tests.engine.speculation_checks import same_tokens
from tests.engine.test_learned_drafts import _cancel_while_drafting, _check_nothing_held, _same, _server_values

SAMPLED = SamplingParams(0.8, 0.95, -1, 0.0, 1.0, 0.0, 0.0, 21)
OFF = SpeculationConfig(mode="off")
DRAFTS = SpeculationConfig(mode="fixed", max_drafts=5, history=False)  # learned drafts only
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


@pytest.fixture(scope="module")
def cores(tiny_cores: TinyCores) -> tuple[Path, Path]:
    """(target, draft): two seeds of the tiny Llama family, one tokenizer (built once per run: the
    serving test of draft cores imports this fixture)."""
    return tiny_cores("llama", "smollm2", 0)[1], tiny_cores("llama", "smollm2", 1)[1]


def _requests(core: Core, max_tokens: int = 24) -> list[EngineRequest]:
    tok = core.tokenizer()
    prompts = [tuple(tok.encode(t).ids) for t in (CODE, "the cat sat on the mat and the cat sat on", "1, 2, 3, 4,")]
    out = [
        EngineRequest(f"r{i}", p, (GREEDY,), max_tokens, ignore_eos=True, num_top_logprobs=2)
        for i, p in enumerate(prompts)
    ]
    return out + [EngineRequest("n2", prompts[1], (GREEDY, SAMPLED), max_tokens, ignore_eos=True, num_top_logprobs=2)]


def _run(target: Core, requests, speculation: SpeculationConfig, draft: Core | None = None, **config):
    engine = build_engine(
        target, EngineConfig(num_pages=config.pop("num_pages", 64), speculation=speculation, draft_core=draft, **config)
    )
    out = run_to_completion(engine, requests)
    _check_nothing_held(engine)
    return out, engine


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(cores: tuple[Path, Path]) -> None:
    target = Core.open(cores[0])
    requests = _requests(target)[:3]  # greedy choices only: a sampled choice may reject a greedy draft
    off, plain = _run(target, requests, OFF)
    spec, engine = _run(target, requests, DRAFTS, Core.open(cores[0]))
    _same(off, spec)
    stats = engine.stats
    assert engine.learned is not None and engine.learned.name == target.manifest.public_id
    assert stats.learned_offered > 3 * 10 and stats.learned_accepted == stats.learned_offered == stats.accepted_drafts
    assert stats.steps < plain.stats.steps / 2


def test_another_seed_drafts_losslessly(cores: tuple[Path, Path]) -> None:
    target, draft = Core.open(cores[0]), Core.open(cores[1])
    requests = _requests(target)
    off, _ = _run(target, requests, OFF)
    stop = tuple(off["r0"][0].token_ids[8:10])
    requests.append(
        EngineRequest(
            "stop",
            requests[0].prompt_ids,
            (GREEDY,),
            24,
            ignore_eos=True,
            num_top_logprobs=2,
            stop_token_sequences=(stop,),
        )
    )
    off, _ = _run(target, requests, OFF)
    assert off["stop"][0].finish is FinishCause.STOP_TOKEN
    for speculation in (DRAFTS, SpeculationConfig(mode="adaptive", max_drafts=4, row_budget=64)):
        spec, engine = _run(target, requests, speculation, draft)
        _same(off, spec)
        stats = engine.stats
        assert stats.draft_steps > 0 and 0 < stats.learned_offered <= stats.verification_drafts
        assert stats.learned_accepted <= stats.learned_offered


def test_preemption_and_cancellation_free_draft_state(cores: tuple[Path, Path]) -> None:
    target, draft = Core.open(cores[0]), Core.open(cores[1])
    requests = _requests(target, max_tokens=32)
    requests[-1] = replace(requests[-1], params=(GREEDY, GREEDY))  # every draft of the target's own accepted
    again = requests + [replace(r, request_id=r.request_id + "b") for r in requests[::2]]
    off, _ = _run(target, again, OFF, num_pages=12, prefill_chunk_size=16)
    spec, engine = _run(target, again, DRAFTS, Core.open(cores[0]), num_pages=12, prefill_chunk_size=16)
    assert engine.stats.preemptions > 0 and engine.stats.learned_accepted == engine.stats.learned_offered > 0
    same_tokens(spec, off)
    engine = build_engine(target, EngineConfig(num_pages=64, speculation=DRAFTS, draft_core=draft))
    _cancel_while_drafting(engine, requests, 5)
    while engine.has_work:
        engine.step()
    _check_nothing_held(engine)


def test_metrics_name_the_draft_core(cores: tuple[Path, Path]) -> None:
    from helios.server.metrics import FirstResponseWindow, json_snapshot

    target, draft = Core.open(cores[0]), Core.open(cores[1])
    engine = build_engine(target, EngineConfig(num_pages=32, speculation=DRAFTS, draft_core=draft))
    run_to_completion(engine, _requests(target, max_tokens=6)[:1])
    snapshot = json_snapshot(_server_values(engine), FirstResponseWindow().summary(now=0.0))
    assert snapshot["learned_drafter"] is True and snapshot["learned_drafter_name"] == draft.manifest.public_id
    assert snapshot["draft_steps"] > 0


def test_a_draft_core_of_another_tokenizer_is_refused(cores: tuple[Path, Path], tmp_path: Path) -> None:
    from helios.server.state import _draft_core

    target, draft = Core.open(cores[0]), Core.open(cores[1])
    assert incompatibility(target.manifest, draft.manifest) is None
    files = dict(target.manifest.files) | {target.manifest.tokenizer.file: "0" * 64}
    other = msgspec.structs.replace(target.manifest, files=files)  # a core whose tokenizer.json differs
    assert "different tokenizer" in (incompatibility(other, draft.manifest) or "")
    stranger = replace(target, manifest=other)
    with pytest.raises(ValueError, match="different tokenizer"):
        build_engine(stranger, EngineConfig(num_pages=16, speculation=DRAFTS, draft_core=draft))
    with pytest.raises(ConfigError, match=r"draft_core / --draft-core .*different tokenizer"):
        _draft_core(ServerConfig(draft_core=str(cores[1])), other)
    assert load_config(None, draft_core=cores[1]).draft_core == str(cores[1])  # --draft-core
    (tmp_path / "bad.toml").write_text("[server]\ndraft_core = 3\n")
    with pytest.raises(ConfigError, match="draft_core must be a nonempty path"):
        load_config(tmp_path / "bad.toml")
    paged = msgspec.structs.replace(
        draft.manifest, limits=msgspec.structs.replace(draft.manifest.limits, page_tokens=32)
    )
    assert "--page-tokens 16" in (incompatibility(target.manifest, paged) or "")
