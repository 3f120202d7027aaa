"""The CUDA-graph runner's logic on CPU (helios.engine.graphs with its EagerBackend double) and
device selection / CUDA KV sizing (helios.engine.devices). No GPU: what needs one is in
docs/serving.md ("CUDA")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from helios.core import Core
from helios.core.program import STEP, allocate_kv
from helios.engine import devices
from helios.engine.graphs import GRAPH_INPUTS, EagerBackend, GraphRunner
from helios.engine.kernels import registry

if TYPE_CHECKING:
    from helios.core.manifest import Manifest
    from helios.engine.executor import Executor, StepResult
    from helios.engine.sequence import Chunk, Sequence

PAGE = 4


class _Recorder:
    """A fake step: records the inputs it saw, returns per-row outputs derived from them."""

    input_names = tuple(sorted(GRAPH_INPUTS - {"window_slot_mapping", "window_block_tables"}))  # no window pool

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, weights, kv, **inputs):
        self.calls.append({k: v.clone() for k, v in inputs.items()})
        rows = inputs["token_ids"].shape[0]
        logits = (inputs["token_ids"] * 10 + inputs["positions"]).float()[:, None].repeat(1, 3)
        return {
            "logits": logits,
            "logsumexp": torch.zeros(rows),
            "explicit_logprobs": inputs["logprob_token_ids"].float(),
        }


def _decode_inputs(tables: list[list[int]], lens: list[int], tokens: list[int], k: int = 1) -> dict[str, torch.Tensor]:
    """A decode-only step's eager inputs, built the way Executor._call builds them."""
    rows, width = len(tables), max(len(t) for t in tables)
    block = torch.zeros((rows, width), dtype=torch.int32)
    for row, table in enumerate(tables):
        block[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    positions = [n - 1 for n in lens]
    return {
        "token_ids": torch.tensor(tokens, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor([t[p // PAGE] * PAGE + p % PAGE for t, p in zip(tables, positions)]),
        "block_tables": block,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.arange(rows + 1, dtype=torch.int32),
        "logits_indices": torch.arange(rows, dtype=torch.int64),
        "logprob_token_ids": torch.arange(rows * k, dtype=torch.int64).view(rows, k),
    }


def _runner(program, buckets=(1, 2, 4, 8), max_blocks=4, scratch=9, explicit=3, kv=None) -> GraphRunner:
    return GraphRunner(
        program,
        {},
        kv if kv is not None else [torch.zeros(10, PAGE, 1, 1)],
        buckets,
        PAGE,
        max_blocks,
        scratch,
        "cpu",
        EagerBackend(),
        explicit_width=explicit,
    )


def test_bucket_is_the_smallest_that_holds_the_rows_and_none_above_the_largest() -> None:
    runner = _runner(_Recorder(), buckets=(8, 1, 2, 4, 4))
    assert runner.buckets == (1, 2, 4, 8)
    assert [runner.bucket_for(r) for r in (1, 2, 3, 4, 5, 8, 9, 0)] == [1, 2, 4, 4, 8, 8, None, None]
    with pytest.raises(ValueError):
        _runner(_Recorder(), buckets=())


def test_padded_rows_use_only_the_scratch_page_and_outputs_are_sliced_to_real_rows() -> None:
    program = _Recorder()
    runner = _runner(program, buckets=(4, 8))
    inputs = _decode_inputs([[0, 1], [2]], [6, 3], [5, 7], k=2)
    out = runner.run(inputs)
    seen = program.calls[-1]
    assert seen["token_ids"].shape == (4,) and seen["block_tables"].shape == (4, 4)
    assert seen["token_ids"].tolist() == [5, 7, 0, 0]
    assert seen["positions"].tolist() == [5, 2, 0, 0]
    assert seen["slot_mapping"].tolist() == [1 * PAGE + 1, 2 * PAGE + 2, 9 * PAGE, 9 * PAGE]
    # real rows: their pages, then the scratch page past their width; padded rows: scratch only
    assert seen["block_tables"].tolist() == [[0, 1, 9, 9], [2, 0, 9, 9], [9, 9, 9, 9], [9, 9, 9, 9]]
    assert seen["seq_lens"].tolist() == [6, 3, 1, 1]
    assert seen["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert seen["logits_indices"].tolist() == [0, 1, 2, 3]
    assert seen["logprob_token_ids"].tolist() == [[0, 1, 0], [2, 3, 0], [0, 0, 0], [0, 0, 0]]
    assert out["logits"].tolist() == [[55.0] * 3, [72.0] * 3]
    assert out["explicit_logprobs"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    # a smaller step in the same bucket: the earlier step's rows are padding again
    runner.run(_decode_inputs([[3]], [1], [4], k=1))
    seen = program.calls[-1]
    assert seen["token_ids"].tolist() == [4, 0, 0, 0] and seen["seq_lens"].tolist() == [1, 1, 1, 1]
    assert seen["block_tables"].tolist() == [[3, 9, 9, 9]] + [[9, 9, 9, 9]] * 3
    runner.run(_decode_inputs([[3], [4], [5]], [2, 2, 2], [1, 1, 1]))
    seen = program.calls[-1]
    assert seen["slot_mapping"].tolist()[3] == 9 * PAGE and seen["block_tables"][3].tolist() == [9, 9, 9, 9]
    assert seen["logprob_token_ids"].tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0], [0, 0, 0]]


def test_capture_once_per_bucket_and_eager_beyond_the_buckets() -> None:
    program = _Recorder()
    runner = _runner(program)
    for rows in (3, 4, 3, 1):
        assert runner.run(_decode_inputs([[r] for r in range(rows)], [1] * rows, [1] * rows)) is not None
    assert runner.backend.captures == 2 and sorted(runner.static) == [1, 4]
    calls = len(program.calls)
    assert runner.run(_decode_inputs([[0]] * 9, [1] * 9, [1] * 9)) is None  # past the largest bucket
    assert runner.run(_decode_inputs([[0, 1, 2, 3, 4]], [17], [1])) is None  # wider than the static tables
    assert runner.run(_decode_inputs([[0]], [1], [1], k=4)) is None  # more explicit ids than the static width
    prefill = _decode_inputs([[0]], [2], [1])
    prefill["token_ids"] = torch.tensor([1, 2])
    assert runner.run(prefill) is None  # not one token per row
    assert len(program.calls) == calls  # declined steps never reach the program


def test_startup_capture_runs_every_bucket_on_padding_only_and_a_failure_is_reported() -> None:
    class Recording(EagerBackend):
        order: list[int] = []

        def capture(self, bucket, step):
            self.order.append(bucket)
            step()  # what CUDA's warm-up runs do: the all-padding step
            super().capture(bucket, step)

    program = _Recorder()
    runner = GraphRunner(program, {}, [torch.zeros(10, PAGE, 1, 1)], (1, 2, 4), PAGE, 4, 9, "cpu", Recording(), 3)
    assert runner.capture_all() is None
    assert runner.backend.order == [4, 2, 1]  # largest first
    for seen in program.calls:  # padding only: the scratch page, one token, nothing real read
        assert set(seen["slot_mapping"].tolist()) == {9 * PAGE} and set(seen["block_tables"].flatten().tolist()) == {9}
        assert set(seen["seq_lens"].tolist()) == {1}
    runner.run(_decode_inputs([[0]], [1], [1]))
    assert runner.backend.captures == 3  # no recapture at the first real step

    class Failing(EagerBackend):
        def capture(self, bucket, step):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    failing = GraphRunner(_Recorder(), {}, [torch.zeros(10, PAGE, 1, 1)], (1, 2), PAGE, 4, 9, "cpu", Failing(), 3)
    assert failing.capture_all() == "RuntimeError: operation not permitted when stream is capturing"


def test_a_replaced_cache_tensor_recaptures() -> None:
    kv = [torch.zeros(10, PAGE, 1, 1)]
    runner = _runner(_Recorder(), kv=kv)
    runner.run(_decode_inputs([[0]], [1], [1]))
    kv[0] = torch.zeros(12, PAGE, 1, 1)[:10]  # what Executor.widen does
    runner.run(_decode_inputs([[0]], [1], [1]))
    assert runner.backend.captures == 1 and runner.backend.captured(1)  # a fresh backend captured again


@pytest.fixture(scope="module")
def tiny(tiny_core: Path):
    registry.register()
    core = Core.open(tiny_core)
    program = core.load_program(STEP, check_guards=False)
    return core, program, core.load_weights("cpu")


def _step_inputs(program, page: int, tables: list[list[int]], lens: list[int], tokens: list[int]) -> dict:
    rows, width = len(tables), max(len(t) for t in tables)
    block = torch.zeros((rows, width), dtype=torch.int32)
    for row, table in enumerate(tables):
        block[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    positions = [n - 1 for n in lens]
    inputs = {
        "token_ids": torch.tensor(tokens),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor([t[p // page] * page + p % page for t, p in zip(tables, positions)]),
        "block_tables": block,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.arange(rows + 1, dtype=torch.int32),
        "logits_indices": torch.arange(rows),
    }
    if "logprob_token_ids" in program.input_names:
        inputs["logprob_token_ids"] = torch.tensor([[1 + 2 * r, 2 + 2 * r] for r in range(rows)])
    return inputs


def test_tiny_core_padded_bucket_step_matches_the_unpadded_step(tiny) -> None:
    """The tiny core's real step: a 3-row decode step run in bucket 4 through the double. Its real
    rows' outputs are exactly those of an eager 4-row step whose 4th row is another real sequence
    (padding does not reach real rows), and within 1e-5 of the unpadded 3-row step: CPU matmuls
    round differently at another row count (measured 2.5e-6 on the logits; the padding and the
    static table width alone change nothing). The padding row writes only the scratch page."""
    core, program, weights = tiny
    m = core.manifest
    page, pages = m.limits.page_tokens, 12
    generator = torch.Generator().manual_seed(0)
    filled = [
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype)) for t in allocate_kv(m.kv, pages + 1, page)
    ]
    scratch = pages
    for t in filled:
        t[scratch].zero_()
    tables, lens, tokens = [[0, 1, 2], [5], [7, 3]], [2 * page + 3, 4, page + 1], [11, 12, 13]
    inputs = _step_inputs(program, page, tables, lens, tokens)
    assert GraphRunner.eligible(program.input_names)
    eager_kv = [t.clone() for t in filled]
    unpadded = program(weights, eager_kv, **inputs)
    four = program(
        weights,
        [t.clone() for t in filled],
        **_step_inputs(program, page, tables + [[9, 10]], lens + [page + 5], tokens + [14]),
    )
    graph_kv = [t.clone() for t in filled]
    runner = GraphRunner(
        program,
        weights,
        graph_kv,
        m.decode_buckets,
        page,
        -(-m.limits.max_model_len // page),
        scratch,
        "cpu",
        EagerBackend(),
        explicit_width=4 if "logprob_token_ids" in inputs else 0,
    )
    assert runner.bucket_for(3) == 4
    got = runner.run(inputs)
    assert set(got) == set(unpadded)
    for name, value in unpadded.items():
        assert got[name].shape == value.shape, name
        assert torch.equal(got[name], four[name][:3, : value.shape[1]] if value.dim() > 1 else four[name][:3]), name
        if value.is_floating_point():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5)
        elif name != "top_ids":  # near-ties may order differently by rounding; the logprobs above agree
            assert torch.equal(got[name], value), name
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    written = inputs["slot_mapping"]
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[written] = False
    for before, eager, graphed in zip(filled, eager_kv, graph_kv):
        # real pages: every slot but the real rows' own is untouched; those hold the eager step's values
        assert torch.equal(flat(graphed[:pages])[untouched], flat(before[:pages])[untouched])
        torch.testing.assert_close(flat(graphed)[written], flat(eager)[written], rtol=0, atol=1e-5)
        assert not torch.equal(flat(eager)[written], flat(before)[written])  # the real rows did write
        assert not torch.equal(graphed[scratch], before[scratch])  # the padding row wrote the scratch page


def test_device_setting_resolves_and_cuda_without_a_device_says_what_to_do() -> None:
    assert devices.resolve("cpu", lambda: True) == "cpu"
    assert devices.resolve("auto", lambda: False) == "cpu"
    assert devices.resolve("auto", lambda: True) == "cuda"
    assert devices.resolve("cuda:1", lambda: True, lambda: 2) == "cuda:1"
    with pytest.raises(devices.DeviceError, match='device = "cpu"'):
        devices.resolve("cuda", lambda: False)
    with pytest.raises(devices.DeviceError, match="cuda:0..cuda:1"):
        devices.resolve("cuda:2", lambda: True, lambda: 2)
    with pytest.raises(devices.DeviceError):
        devices.resolve("gpu", lambda: True)
    if not torch.cuda.is_available():  # this host: auto is cpu
        assert devices.resolve("auto") == "cpu"


def test_cuda_kv_pages_from_free_memory() -> None:
    mib = 1 << 20
    assert devices.kv_pages_for(1000 * mib, 0.9, mib, 100 * mib) == 800
    assert devices.kv_pages_for(1000 * mib, 1.0, 3 * mib, 0) == 333
    assert devices.kv_pages_for(10 * mib, 0.5, mib, 4 * mib) == 1
    with pytest.raises(devices.DeviceError, match="does not fit"):
        devices.kv_pages_for(10 * mib, 0.5, mib, 5 * mib)
    with pytest.raises(devices.DeviceError, match="kv_memory_fraction"):
        devices.kv_pages_for(10 * mib, 0.0, mib, 0)
    with pytest.raises(ValueError):
        devices.kv_pages_for(10 * mib, 0.5, 0, 0)


def eager_decode_step(
    executor: Executor, seqs: list[Sequence]
) -> tuple[tuple[Chunk, ...], StepResult, list[torch.Tensor]]:
    """Prefill `seqs`, give each one more token and run that decode step eagerly, then put the
    caches back as they were before it, so the same step can run again through a runner.
    Returns (the decode step's chunks, its eager result, the caches before it)."""
    from helios.engine.sequence import Chunk

    executor.run(tuple(Chunk(s, 0, len(s.token_ids), True, False) for s in seqs))
    for index, seq in enumerate(seqs):
        seq.token_ids.append(20 + index)
    decode = tuple(Chunk(s, len(s.token_ids) - 1, 1, True, False) for s in seqs)
    before = [t.clone() for t in executor.kv]
    eager = executor.run(decode)
    for tensor, saved in zip(executor.kv, before):
        tensor.copy_(saved)
    return decode, eager, before


def eager_runner(executor: Executor, manifest: Manifest, scratch_page: int, **options: Any) -> GraphRunner:
    """A runner of the executor's step on its caches, buckets 1, 2 and 4, through the CPU double."""
    return GraphRunner.for_core(
        manifest,
        executor.step,
        executor.weights,
        executor.kv,
        executor.page_tokens,
        scratch_page,
        "cpu",
        EagerBackend(),
        buckets=(1, 2, 4),
        **options,
    )


def test_executor_routes_decode_only_steps_through_the_runner(tiny_core: Path) -> None:
    """Executor._call's wiring, on CPU with the double injected (on CPU the executor never builds a
    runner itself): decode-only steps replay, prefill steps stay eager, both are counted, and the
    replayed step's outputs match the eager one's."""
    from types import SimpleNamespace

    from helios.engine.executor import Executor
    from helios.engine.sequence import Chunk, Sequence

    core = Core.open(tiny_core)
    pages = 16
    executor = Executor(core, pages, "cpu", 0, compiled=False)
    assert executor.graphs is None and executor.kv[0].shape[0] == pages  # CPU: no runner, no scratch page
    page = executor.page_tokens
    request = SimpleNamespace(logprob_token_ids=None)
    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13] * (page + 2)]
    seqs = [Sequence(request, 0, list(p), len(p), i, pages=[2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    decode, eager, _ = eager_decode_step(executor, seqs)
    assert executor.launches == {"graph": 0, "eager": 2}
    executor.graphs = eager_runner(executor, core.manifest, pages - 1)
    graphed = executor.run(decode)
    assert executor.launches == {"graph": 1, "eager": 2}
    torch.testing.assert_close(graphed.logits, eager.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(graphed.logsumexp, eager.logsumexp, rtol=0, atol=1e-5)
    assert graphed.sampled == eager.sampled
    extra = Sequence(request, 0, [1, 2, 3], 3, 9, pages=[8])
    executor.run((Chunk(extra, 0, 3, True, False),))  # a prefill step: eager
    assert executor.launches == {"graph": 1, "eager": 3}
