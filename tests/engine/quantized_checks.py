"""What the quantized-core tests compare: a few greedy requests' tokens and logprobs."""

from __future__ import annotations

from helios.engine import LLMEngine
from helios.engine.offline import run_to_completion
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY


def answers(engine: LLMEngine, tokens: int = 10) -> dict[str, tuple[list[int], list[float]]]:
    """Four greedy requests at once (prefill, then a batched decode), each with its top-3 alternatives."""
    requests = [
        EngineRequest(f"r{i}", tuple(range(5 + i, 14 + 3 * i)), (GREEDY,), tokens, ignore_eos=True, num_top_logprobs=3)
        for i in range(4)
    ]
    out = run_to_completion(engine, requests)
    return {name: (c.token_ids, [e.logprob for e in c.logprobs]) for name, (c,) in out.items()}
