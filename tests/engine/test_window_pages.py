"""The window pool (helios.engine.memory.window_pages): tiny Gemma 3, Gemma 4 and Step 3.7 cores' sliding
layers (window 8, 16-token pages; Gemma 4's KV-shared layers reading them there) keep their keys and
values in a second pool whose pages are freed behind the window. Outputs equal those of the same core with both tables on the main pool (and each request
run alone), through long prompts, batching, chunked prefill, prefix reuse, forks, preemption and
speculation; the window pages a sequence holds stay bounded by the window, not its length; a
prefix is reused only as far as the window pages its first query needs survive."""

from __future__ import annotations

import pytest
from support import TinyCores

from helios.core import Core
from helios.engine import EngineConfig, LLMEngine, build_engine
from helios.engine.memory.kv_cache import ROOT_HASH, PagePool, page_hash
from helios.engine.memory.window_pages import NONE, WindowPages, pool_pages
from helios.engine.offline import ChoiceOutput, collect
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY, SamplingParams
from helios.engine.sequence import Sequence
from helios.engine.speculation.drafter import SpeculationConfig
from tests.engine.speculation_checks import same_tokens, wrong_every_third
from tests.engine.test_graphs import eager_decode_step, eager_runner
from tests.ignition.family_checks import TEXTS, export_tiny

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)

SAMPLED = SamplingParams(0.9, 0.95, 50, 0.0, 1.0, 0.0, 0.0, 11)


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "step5", "mimo_v2"])
def core(request: pytest.FixtureRequest, tiny_cores: TinyCores) -> Core:
    """The family's tiny core, the one its own tests check (built once per run)."""
    family = request.param
    core = Core.open(export_tiny(family, family, tiny_cores)[1])
    pooled = core.manifest.kv.window_pool
    assert pooled is not None and pooled.window == 8
    windows = [i for i in range(core.manifest.kv.num_caches) if i in pooled.caches]
    assert 0 < len(windows) < core.manifest.kv.num_caches  # global layers' caches stay in the main pool
    if family == "gemma3":
        assert pooled.caches == (0, 1, 4, 5)
    return core


def _prompts(core: Core) -> list[tuple[int, ...]]:
    tok = core.tokenizer()
    long = " ".join(TEXTS) * 2  # many pages, far past the window
    return [tuple(tok.encode(text).ids) for text in (long, TEXTS[0], TEXTS[1] + " " + TEXTS[2], long[:300])]


def _requests(core: Core, max_tokens: int = 24) -> list[EngineRequest]:
    prompts = _prompts(core)
    requests = [
        EngineRequest(f"g{i}", p, (GREEDY,), max_tokens, ignore_eos=True, num_top_logprobs=2)
        for i, p in enumerate(prompts)
    ]
    requests.append(EngineRequest("n2", prompts[2], (GREEDY, SAMPLED), max_tokens, ignore_eos=True, num_top_logprobs=2))
    return requests


def _engine(core: Core, **overrides) -> LLMEngine:
    return build_engine(core, EngineConfig(**{"num_pages": 96, "prefill_chunk_size": 16, **overrides}))


def _run(engine: LLMEngine, requests: list[EngineRequest], peak: list[int] | None = None) -> dict:
    """Step to completion, checking the pools after every step (and the window pages each sequence holds)."""
    outputs = {r.request_id: [ChoiceOutput() for _ in range(r.n)] for r in requests}
    for request in requests:
        engine.add(request)
    window = engine.window
    bound = None
    if window is not None:  # after a step: the window behind the next query, plus one page begun early
        bound = -(-(window.window - 1) // window.page_tokens) + 2 + int(engine.scheduler.drafter.enabled)
    while engine.has_work:
        for event in engine.step():
            collect(outputs, event)
        engine.scheduler.check_invariants()
        if bound is not None:
            for seq in engine.scheduler.running:
                held = [p for p in seq.window_pages if p != NONE]
                assert len(held) <= bound, (len(seq.token_ids), seq.window_pages)
                assert all(p == NONE for p in seq.window_pages[: window.first_needed(seq.num_computed)])
            if peak is not None:
                peak.append(sum(1 for count in window.pool.ref_count if count))
    engine.scheduler.check_invariants()
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages
    if window is not None:
        assert all(count == 0 for count in window.pool.ref_count)
    return outputs


def _same(a: dict, b: dict, tolerance: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            assert x.token_ids == y.token_ids, key
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert abs(p.logprob - q.logprob) <= tolerance
                assert [t for t, _ in p.alternatives] == [t for t, _ in q.alternatives]


def test_outputs_equal_the_unreclaimed_core_and_window_pages_stay_bounded(core: Core) -> None:
    requests = _requests(core)
    mirrored = _run(_engine(core, reclaim_window_pages=False), requests)
    engine = _engine(core)
    # as many window pages as the main pool (equal token capacity): fewer than 64 sequences could hold
    assert engine.window is not None and engine.window.pool.num_pages == engine.pool.num_pages == 96
    assert pool_pages(8, 16, 64, 16, 0) == 64 * 4 + 1
    roomy = _engine(core, num_pages=400)  # more than they could: the window pool stops there, the rest is main pool
    kv = core.manifest.kv
    assert roomy.window is not None and roomy.window.pool.num_pages == 257
    assert roomy.pool.num_pages == 400 + (400 - 257) * kv.window_token_elements // kv.token_elements
    peak: list[int] = []
    pooled = _run(engine, requests, peak)
    _same(mirrored, pooled)
    longest = max(len(r.prompt_ids) for r in requests) + 24
    assert longest > 8 * 16  # the long prompt spans many pages; its sliding layers held two or three at a time
    assert max(peak) <= 6 * 3  # six sequences (one forked) of at most three pages each, whatever their length
    for request in requests[:2]:  # and each request alone, without the prefix cache
        alone = _run(_engine(core, enable_prefix_cache=False), [request])
        assert alone[request.request_id][0].token_ids == pooled[request.request_id][0].token_ids


def test_prefix_reuse_with_window_pages_and_preemption(core: Core) -> None:
    """A second request sharing a long prefix resumes from the cache (its window pages were
    published and kept); a main pool so small that sequences are preempted and recomputed."""
    prompts = _prompts(core)
    first = EngineRequest("a", prompts[0], (GREEDY,), 12, ignore_eos=True)
    second = EngineRequest("b", prompts[0][:-5] + prompts[1][:6], (GREEDY,), 12, ignore_eos=True)
    uncached = _run(_engine(core, enable_prefix_cache=False), [second])["b"][0]
    engine = _engine(core)
    _run(engine, [first])
    cached = _run(engine, [second])["b"][0]
    assert cached.num_cached_tokens >= 16 * ((len(second.prompt_ids) - 6) // 16 - 1)
    assert cached.token_ids == uncached.token_ids
    requests = [r for r in _requests(core, max_tokens=20) if len(r.prompt_ids) < 100]  # each fits 8 pages alone
    plain = _run(_engine(core, reclaim_window_pages=False, enable_prefix_cache=False), requests)
    small = _engine(core, num_pages=8)
    squeezed = _run(small, requests)
    assert small.stats.preemptions > 0
    same_tokens(squeezed, plain)


def test_speculation_with_window_pages(core: Core) -> None:
    """Drafts (the plain run's own continuation, every third round's middle one wrong) write window
    pages past the committed tokens; rejected ones are overwritten, never read."""
    requests = _requests(core)
    plain = _run(_engine(core), requests)
    oracle = wrong_every_third(plain, requests)
    engine = _engine(core, speculation=SpeculationConfig(mode="fixed", max_drafts=4))
    engine.scheduler.drafter.propose = oracle
    spec = _run(engine, requests)
    _same(plain, spec, tolerance=1e-4)
    assert engine.stats.verification_drafts > engine.stats.accepted_drafts > 0


def test_reuse_stops_where_a_window_page_was_evicted() -> None:
    """WindowPages.reusable: the most matched pages whose window (the last window - 1 positions
    before them) is cached; an evicted window page shortens the reuse to before it."""
    size, window = 4, 6
    tokens = list(range(100, 124))  # six full pages
    pool = PagePool(8, size)
    pages = WindowPages(pool, window)
    held = [pool.allocate() for _ in range(6)]
    chain, parent = [], ROOT_HASH
    for index, page in enumerate(held):
        parent = pool.publish(page, parent, b"", tuple(tokens[index * size : (index + 1) * size]))
        chain.append(parent)
    assert chain[-1] == page_hash(chain[-2], b"", tuple(tokens[20:24]))
    pool.release([held[5], *held[:5]])  # cached, unreferenced; page 5 least recently used
    seq = Sequence(EngineRequest("r", tuple(tokens), (GREEDY,), 4), 0, list(tokens), len(tokens), 0)
    assert pages.reusable(seq, chain, tokens) == 6  # its first query (position 24) reads pages 4 and 5
    assert seq.window_pages == [NONE] * 4 + held[4:]
    pages.release(seq)  # pages 4 and 5 go back as the most recently used
    taken = [pool.allocate() for _ in range(3)]  # two free pages, then the least recently used: page 0
    assert pool.page_of(chain[0]) is None and pool.page_of(chain[5]) is not None
    assert pages.reusable(seq, chain, tokens) == 6  # page 0 is behind every window: not needed
    pages.release(seq)
    pool.release(taken)
    again = PagePool(8, size)  # now evict page 5 alone: resuming at 24 needs it, at 20 only pages 3 and 4
    pages = WindowPages(again, window)
    held = [again.allocate() for _ in range(6)]
    parent = ROOT_HASH
    for index, page in enumerate(held):
        parent = again.publish(page, parent, b"", tuple(tokens[index * size : (index + 1) * size]))
    again.release([held[5], *held[:5]])
    taken = [again.allocate() for _ in range(3)]  # two free pages, then page 5
    assert again.page_of(chain[5]) is None
    assert pages.reusable(seq, chain, tokens) == 5
    assert seq.window_pages == [NONE] * 3 + held[3:5]
    pages.release(seq)
    again.release(taken)
    assert all(count == 0 for count in again.ref_count)


def test_a_short_window_pool_cuts_chunks_and_preempts_without_changing_output(core: Core) -> None:
    """Five window pages for six sequences needing one or two each: prefill chunks are cut to the
    pages left, admission waits, decoding sequences preempt the newest; outputs are unchanged."""
    requests = _requests(core, max_tokens=40)
    plain = _run(_engine(core, reclaim_window_pages=False, enable_prefix_cache=False), requests)
    engine = _engine(core)
    assert engine.window is not None
    engine.window.pool = PagePool(5, 16)  # the executor's window caches are larger: any id below 7 is valid
    running: list[int] = []
    step = engine.step

    def counted():
        events = step()
        running.append(len(engine.scheduler.running))
        return events

    engine.step = counted  # type: ignore[method-assign]
    squeezed = _run(engine, requests)
    assert max(running) < 6 <= sum(r.n for r in requests)  # the window pool, not the main pool, held them back
    assert engine.stats.preemptions > 0  # a decoding sequence crossing into a new page, with none left
    same_tokens(squeezed, plain)


def test_decode_steps_replay_through_the_graph_runner_with_window_tables(core: Core) -> None:
    """The CUDA-graph runner's padding on CPU (its EagerBackend double): a decode step of a window-pool
    core through a bucket, its window slots and tables padded with the window caches' own scratch
    page, gives the eager step's outputs; the padding row writes only the two scratch pages."""
    from types import SimpleNamespace

    import torch

    from helios.engine.executor import Executor
    from helios.engine.graphs import GraphRunner

    pages, window_pages = 16, 10  # the last of each is the runner's scratch page
    executor = Executor(core, pages, "cpu", 0, compiled=False, num_window_pages=window_pages)
    page = executor.page_tokens
    request = SimpleNamespace(logprob_token_ids=None, images=())
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13] * (page + 2)]
    seqs = [
        Sequence(request, 0, list(p), len(p), i, pages=[2 * i, 2 * i + 1], window_pages=[3 * i, 3 * i + 1])
        for i, p in enumerate(prompts)
    ]
    decode, eager, before = eager_decode_step(executor, seqs)
    m = core.manifest
    assert GraphRunner.eligible(executor.step.input_names)
    executor.graphs = eager_runner(executor, m, pages - 1, window_scratch_page=window_pages - 1)
    graphed = executor.run(decode)
    assert executor.launches["graph"] == 1
    torch.testing.assert_close(graphed.logits, eager.logits, rtol=0, atol=1e-5)
    assert graphed.sampled == eager.sampled
    windowed = set(m.kv.window_pool.caches)
    used = {index: {2 * i for i in range(3)} | {2 * i + 1 for i in range(3)} for index in range(len(executor.kv))}
    for index, (tensor, saved) in enumerate(zip(executor.kv, before)):
        scratch = window_pages - 1 if index in windowed else pages - 1
        touched = {p for p in range(tensor.shape[0]) if not torch.equal(tensor[p], saved[p])}
        allowed = {3 * i + j for i in range(3) for j in (0, 1)} if index in windowed else used[index]
        assert touched <= allowed | {scratch}, (index, touched)
