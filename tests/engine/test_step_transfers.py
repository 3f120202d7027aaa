"""One device-to-host copy per step: sampling without host reads (Sampler(host_reads=False), what an
accelerator runs), the packed copy (step_output.to_host, HostCopy), and an engine step that reads device
values only through it, with the same tokens and logprobs as before.

No GPU here: "a host read" is any call that turns a tensor's values into Python values (tolist,
item, cpu, numpy, bool/int/float/index), counted by patching torch.Tensor while the code runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from helios.core import Core
from helios.engine import EngineConfig, build_engine, step_output
from helios.engine.executor import StepResult
from helios.engine.logprobs import listed_alternatives, natural_alternatives, scanned_alternatives
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampler import MaskError, Sampler, position_generator
from helios.engine.sampling_params import SamplingParams

NEUTRAL = SamplingParams(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 0)
READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _params(**changes: object) -> SamplingParams:
    return dataclasses.replace(NEUTRAL, **changes)


class ReadCounter:
    """Counts host reads of tensor values while `counting`, except inside the copy boundary
    (step_output.HostCopy: its start, counted as a copy, and its wait)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[str] = []
        self.copies = 0
        self.counting = False
        self._inside = False
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        start, wait = step_output.HostCopy.__init__, step_output.HostCopy.wait

        def started(copy, parts):
            if self.counting:
                self.copies += 1
            with self._boundary():
                start(copy, parts)

        def waited(copy):
            with self._boundary():
                return wait(copy)

        monkeypatch.setattr(step_output.HostCopy, "__init__", started)
        monkeypatch.setattr(step_output.HostCopy, "wait", waited)

    @contextmanager
    def _boundary(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def _wrap(self, name: str, original):
        def wrapper(tensor, *args, **kwargs):
            if self.counting and not self._inside:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)

        return wrapper

    @contextmanager
    def active(self) -> Iterator[None]:
        self.counting = True
        try:
            yield
        finally:
            self.counting = False


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], step: int = 0, **kwargs):
    batch = len(params)
    generators = [position_generator(p.seed, step) if p.top_k != 1 else None for p in params]
    ids = kwargs.pop("output_ids", [torch.empty(0, dtype=torch.int64)] * batch)
    return sampler.sample(logits, params, generators, [torch.tensor([1, 2, 3])] * batch, ids, **kwargs)


MIXED = [
    _params(top_k=1),
    _params(temperature=0.7, top_p=0.9, seed=3),
    _params(top_k=40, min_p=0.05, seed=4),
    _params(top_k=1, repetition_penalty=1.3, presence_penalty=0.5),
    _params(temperature=1.3, frequency_penalty=0.4, seed=5, logit_bias=((7, 5.0),)),
    _params(seed=6),
]


def test_sampling_without_host_reads_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = ReadCounter(monkeypatch)
    logits = torch.randn(len(MIXED), 3000, generator=torch.Generator().manual_seed(0)) * 3
    output_ids = [torch.tensor([5, 5, 9])] * len(MIXED)
    sampler = Sampler(host_reads=False)
    with counter.active():
        tokens = _sample(sampler, logits, MIXED, output_ids=output_ids)
        greedy = _sample(sampler, logits[:4], [_params(top_k=1)] * 3 + [_params(top_k=1, seed=1)])
    assert counter.reads == []
    assert tokens.shape == (len(MIXED),) and tokens.dtype == torch.int64
    assert greedy.shape == (4,)


def test_the_cpu_sampler_still_takes_its_host_shortcuts(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = ReadCounter(monkeypatch)
    logits = torch.randn(len(MIXED), 3000, generator=torch.Generator().manual_seed(0)) * 3
    with counter.active():
        _sample(Sampler(), logits, MIXED)
    assert "tolist" in counter.reads  # the candidate sets' masses: free on the host, a stall on a device


def test_a_host_mask_is_checked_on_the_host_and_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(3, 50, dtype=torch.bool)
    allowed[:, 10:12] = True
    copies: list[torch.dtype] = []
    original = torch.Tensor.to

    def to(tensor, *args, **kwargs):
        if tensor.dtype == torch.bool:
            copies.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    params = [_params(top_k=1), _params(seed=2), _params(top_p=0.5, seed=3)]
    tokens = _sample(Sampler(host_reads=False), logits, params, allowed=allowed)
    assert set(tokens.tolist()) <= {10, 11}
    assert len(copies) == 1
    allowed[1] = False
    with pytest.raises(MaskError, match=r"rows \[1\]"):
        _sample(Sampler(host_reads=False), logits, params, allowed=allowed)


def test_greedy_and_whole_vocabulary_rows_match_the_host_path_exactly() -> None:
    generator = torch.Generator().manual_seed(2)
    for trial in range(20):
        logits = torch.randn(6, 2000, generator=generator).round(decimals=1)  # ties: the lowest id wins
        params = [
            _params(top_k=1),
            _params(top_k=1, repetition_penalty=1.5),
            _params(seed=trial),
            _params(temperature=0.5, seed=trial + 1),
            _params(top_k=1, logit_bias=((3, 2.0),)),
            _params(temperature=2.0, presence_penalty=1.0, seed=trial + 2),
        ]
        host = _sample(Sampler(), logits, params, step=trial)
        device = _sample(Sampler(host_reads=False), logits, params, step=trial)
        assert torch.equal(host, device)


def test_top_k_and_top_p_rows_without_host_reads_follow_the_same_distribution() -> None:
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * 3
    for params in (_params(top_p=0.9), _params(top_k=30), _params(top_k=200, top_p=0.8, min_p=0.05)):
        rows = logits[None].repeat(3000, 1)
        counts = []
        for sampler in (Sampler(), Sampler(host_reads=False)):
            generators = [torch.Generator().manual_seed(i) for i in range(3000)]
            none = [torch.empty(0, dtype=torch.int64)] * 3000
            drawn = sampler.sample(rows, [params] * 3000, generators, none, none)
            counts.append(torch.bincount(drawn, minlength=2000).float() / 3000)
        host, device = counts
        assert float((host - device).abs().sum()) < 0.15  # total variation of two 3000-sample estimates


def test_to_host_packs_every_tensor_into_one_exact_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: calls.append(t.shape) or original(t, *a, **k))
    values = torch.tensor([[0.1, -math.inf], [3.4028e38, -1e-30]], dtype=torch.float32)
    ids = torch.tensor([0, 2**40 + 1, 151_935])
    host = step_output.to_host(
        {"values": values, "ids": ids, "scalar": torch.tensor(7), "empty": torch.empty(0, 4), "flags": ids > 5}
    )
    assert len(calls) == 1
    assert host["values"] == values.tolist()
    assert host["ids"] == [0, 2**40 + 1, 151_935] and all(type(v) is int for v in host["ids"])
    assert host["scalar"] == 7 and host["empty"] == [] and host["flags"] == [0, 1, 1]
    assert step_output.to_host({}) == {}


def _result(logits: torch.Tensor, num_top: int, explicit: torch.Tensor | None = None) -> StepResult:
    lse = torch.logsumexp(logits, dim=-1)
    top = torch.topk(logits - lse[:, None], num_top)
    return StepResult((), logits, lse, top.values, top.indices, explicit, {})


def test_fetched_logprobs_equal_the_row_reads_they_replace() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 3, (5, 40), generator=generator).float()  # many ties at every cut-off
    result = _result(logits, 4, explicit=torch.randn(5, 3, generator=generator))
    rows = [4, 0, 0, 2, 3]
    tokens = torch.tensor([1, 7, 39, 0, 5])
    asks = [4, 2, None, 4, 0]
    host = step_output.fetch(result, rows, tokens, asks)
    assert host.tokens == (1, 7, 39, 0, 5)
    assert set(host.logprobs) == {0, 1, 3, 4}
    for index, (row, token, ask) in enumerate(zip(rows, tokens.tolist(), asks)):
        if ask is None:
            continue
        values = host.logprobs[index]
        assert values.logsumexp == float(result.logsumexp[row])
        assert values.chosen_logit - values.logsumexp == float(logits[row, token]) - float(result.logsumexp[row])
        assert list(values.explicit) == result.explicit_logprobs[row].tolist()
        expected = natural_alternatives(
            logits[row], values.logsumexp, result.top_logprobs[row], result.top_ids[row], ask
        )
        listed = listed_alternatives(values.top_values, values.top_ids, ask, values.at_cutoff)
        got = (
            listed
            if listed is not None
            else scanned_alternatives(
                step_output.logits_row(result, row), values.logsumexp, values.top_values[ask - 1], ask
            )
        )
        assert got == expected


def test_prompt_scores_come_back_as_host_lists() -> None:
    logits = torch.randn(1, 10)
    scores = {
        "prompt_logprobs": torch.tensor([-1.5, -math.inf]),
        "prompt_ranks": torch.tensor([1, 10]),
        "prompt_top_logprobs": torch.tensor([[-0.5, -1.0], [-0.2, -3.0]]),
        "prompt_top_ids": torch.tensor([[4, 2], [9, 1]]),
    }
    result = StepResult((), logits, torch.logsumexp(logits, -1), None, None, None, {11: scores})
    host = step_output.fetch(result, [], None, [])
    assert host.tokens == () and host.logprobs == {}
    assert host.prompt_scores == {11: {name: t.tolist() for name, t in scores.items()}}


def _requests() -> list[EngineRequest]:
    prompt = tuple(range(5, 40))
    sampled = _params(temperature=0.8, top_p=0.9, seed=11)
    return [
        EngineRequest("greedy", prompt, (_params(top_k=1),), 6, ignore_eos=True, num_top_logprobs=3),
        EngineRequest("scored", prompt[:20], (_params(top_k=1),), 4, ignore_eos=True, prompt_logprobs=2),
        EngineRequest("penalized", prompt[3:], (_params(top_k=1, repetition_penalty=1.4),), 6, ignore_eos=True),
        EngineRequest("n2", prompt[5:], (sampled, dataclasses.replace(sampled, seed=12)), 5, ignore_eos=True),
    ]


def test_an_engine_step_copies_to_the_host_once(tiny_core: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = Core.open(tiny_core)
    before = run_to_completion(build_engine(core, EngineConfig(num_pages=64)), _requests())

    engine = build_engine(core, EngineConfig(num_pages=64))
    engine.sampler = Sampler(host_reads=False)  # what a device runs: no value leaves it while sampling
    counter = ReadCounter(monkeypatch)
    copies_per_step: list[int] = []
    start_sampling, finish_sampling = engine._start_sampling, engine._finish_sampling

    def started(plan, result):
        counter.copies = 0
        with counter.active():
            return start_sampling(plan, result)

    def finished(plan, result, sampling):
        with counter.active():
            output = finish_sampling(plan, result, sampling)
        copies_per_step.append(counter.copies)
        return output

    monkeypatch.setattr(engine, "_start_sampling", started)
    monkeypatch.setattr(engine, "_finish_sampling", finished)
    after = run_to_completion(engine, _requests())
    assert counter.reads == []
    assert copies_per_step and set(copies_per_step) == {1}
    assert all(choice.error is None for choices in after.values() for choice in choices)
    for key in ("greedy", "scored", "penalized"):  # greedy rows: the same tokens and logprobs
        assert after[key] == before[key]
