"""Answers of one engine at N tensor-parallel ranks, as JSON (run as a process by test_tp_*.py):

    python tests/parallel/tp_answers.py CORE OUT.json --tensor-parallel N [--expert-parallel] [--port P]

Greedy 64-token answers with top-20 logprobs, explicit-id logprobs and prompt logprobs, three requests
batched together, through build_engine (rank 0 starting the other ranks, as `helios serve` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helios.core import Core
from helios.engine.build import build_engine
from helios.engine.engine import EngineConfig
from helios.engine.offline import run_to_completion
from helios.engine.parallel import launch
from helios.engine.parallel.world import rank_core
from helios.engine.request import EngineRequest
from helios.engine.sampling_params import GREEDY
from helios.engine.speculation.drafter import SpeculationConfig

PROMPTS = ((5, 17, 42, 99, 7, 3, 250, 11, 64, 80, 2), (9, 8, 7, 6, 5, 4, 3, 2, 1) * 3, (100, 200, 33))
TOKENS = 64


def requests() -> list[EngineRequest]:
    out = [
        EngineRequest(f"top{i}", p, (GREEDY,), TOKENS, ignore_eos=True, num_top_logprobs=20, prompt_logprobs=20)
        for i, p in enumerate(PROMPTS)
    ]
    out.append(EngineRequest("ids", PROMPTS[0], (GREEDY,), TOKENS, ignore_eos=True, logprob_token_ids=(0, 3, 77, 150)))
    return out


def engine_answers(core_dir: Path, tensor: int = 1, expert: bool = False, port: int = 29511) -> dict:
    """The answers (JSON-ready) of an engine over `core_dir` at `tensor` ranks (this process rank 0)."""
    core = Core.open(core_dir)
    world = None
    if tensor > 1:
        plan = launch.plan_from(tensor, expert, 1, 0, "127.0.0.1", port, 60.0, {})
        world = launch.start(core, plan, "cpu")
        core = rank_core(core, tensor, 0, expert)
    config = EngineConfig(
        num_pages=128,
        serial_decode_rows=0,
        speculation=SpeculationConfig(mode="off"),
        parallel=world,
        prefill_chunk_size=16,
    )
    answers = run_to_completion(build_engine(core, config), requests())
    result = {}
    for rid, (choice,) in answers.items():
        prompt = [
            None if entry is None else {str(t): [v.logprob, v.rank] for t, v in entry.items()}
            for entry in (choice.prompt_logprobs or ())
        ]
        result[rid] = {
            "tokens": choice.token_ids,
            "logprobs": [[e.token_id, e.logprob, [list(a) for a in e.alternatives]] for e in choice.logprobs],
            "prompt": prompt,
            "error": choice.error,
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("core", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--port", type=int, default=29511)
    args = parser.parse_args()
    result = engine_answers(args.core, args.tensor_parallel, args.expert_parallel, args.port)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
