"""Tensor-parallel test helpers: tiny cores exported with 2-rank layouts (session fixtures, built once),
answers of an engine at N ranks (tp_answers.py in a process), their comparison, and a server at N
ranks in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import slow_tests

from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
TOLERANCE = 1e-4  # every logprob, fp32 tiny cores (issue 43)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
SLOW = pytest.mark.skipif(not slow_tests(), reason="slow: set FLARE_SLOW_TESTS=1")


# SmolLM2-135M's head counts (9 query heads, 3 KV heads) and an odd MLP width: at 2 ranks nothing
# divides, so the ranks split by whole KV groups (rank 0 KV heads 0-1, rank 1 KV head 2 and a zero
# group) and uneven MLP shares (50 + 49, padded): ignition.parallel_rules.kv_groups.
UNEVEN = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 99}


def llama_core(root: Path, overrides: dict | None = None) -> Path:
    """A tiny Llama (fp32, prompt logprobs) declaring tensor-parallel sizes 1 and 2."""
    write_testmodel("llama", root / "ckpt", seed=0, overrides=overrides)
    options = ExportOptions(out=root / "core", prompt_logprobs=True, tensor_parallel=(1, 2))
    export_core(open_source(str(root / "ckpt")), load_recipe("smollm2"), options)
    return root / "core"


@pytest.fixture(scope="session")
def tp_llama_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with SmolLM2's uneven head counts (UNEVEN), sizes 1 and 2: the server tests' core."""
    return llama_core(tmp_path_factory.mktemp("tp-llama"), UNEVEN)


@pytest.fixture(scope="session")
def tp_moe_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top 2; fp32) whose 2-rank layout splits the experts 2/2."""
    root = tmp_path_factory.mktemp("tp-moe")
    write_testmodel("qwen3_moe", root / "ckpt", seed=3)
    options = ExportOptions(out=root / "core", prompt_logprobs=True, tensor_parallel=(1, 2), expert_parallel=True)
    export_core(open_source(str(root / "ckpt")), load_recipe(str(DATA / "tiny_qwen3_moe.toml")), options)
    return root / "core"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(core: Path, out: Path, *flags: str) -> dict:
    """tp_answers.py's JSON for `core` with `flags` (e.g. --tensor-parallel 2), one thread a rank."""
    command = [sys.executable, str(ROOT / "tests" / "parallel" / "tp_answers.py"), str(core), str(out)]
    command += [*flags, "--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_same_answers(one: dict, many: dict) -> float:
    """Greedy tokens equal, every logprob within TOLERANCE (alternatives in the same order, explicit
    ids, prompt logprobs and ranks); returns the largest difference."""
    worst = 0.0
    assert one.keys() == many.keys()
    for rid, a in one.items():
        b = many[rid]
        assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
        assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 64, rid
        for (token_a, lp_a, alts_a), (token_b, lp_b, alts_b) in zip(a["logprobs"], b["logprobs"], strict=True):
            assert token_a == token_b
            assert [t for t, _ in alts_a] == [t for t, _ in alts_b], rid
            worst = max([worst, abs(lp_a - lp_b), *(abs(x - y) for (_, x), (_, y) in zip(alts_a, alts_b))])
        for pa, pb in zip(a["prompt"], b["prompt"], strict=True):
            assert (pa is None) == (pb is None)
            if pa is None:
                continue
            assert pa.keys() == pb.keys() and all(pa[t][1] == pb[t][1] for t in pa), rid
            worst = max([worst, *(abs(pa[t][0] - pb[t][0]) for t in pa)])
    assert worst <= TOLERANCE, worst
    return worst


class RankServer:
    """`helios serve CORE --tensor-parallel N ...` in a subprocess (rank 0; it starts the others)."""

    def __init__(self, core: Path, log: Path, *flags: str, health: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "helios", "serve", str(core), "--port", str(self.port), *flags]
        self.log = log
        self.process = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD}, cwd=ROOT
        )
        if health:
            self.wait_healthy()

    def wait_healthy(self, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"helios exited: {self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # waiting for the port to open, not for a result
        self.stop()
        raise RuntimeError(f"helios did not become healthy: {self.log.read_text()[-4000:]}")

    def workers(self) -> list[int]:
        """The pids of the worker ranks rank 0 started."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [int(p) for p in children if b"helios.engine.parallel" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
