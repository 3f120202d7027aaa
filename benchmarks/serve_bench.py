"""Load generator for any OpenAI-compatible server (helios, llama-server, vLLM, ...).

    python benchmarks/serve_bench.py http://127.0.0.1:8000 [--model M] [--scenario all] [--json out.json]
    python benchmarks/serve_bench.py URL --scenario sweep --levels 1,64 --device cuda

Scenarios (prompts are fixed and seeded, so runs are comparable):
  single   one stream, 128 output tokens
  sweep    concurrency 1/4/16/32/64 of short chats, 128 output tokens each
  prefix   a 1,500-token shared system prompt with distinct user turns: cold vs warm TTFT
  prefill  a 2,000-token prompt, 1 output token
  busy     32 concurrent short chats (one sweep level)
  edit     one stream: a ~300-line source file in the prompt, returned with a small change
           (the workload speculative decoding targets); helios also reports its acceptance
           rate and DEPTH over the run from /metrics
Reports output tokens/s, requests/s, TTFT p50/p99, inter-token latency p50/p99, errors, and requests sent
again once because the connection dropped before any response (a stale keep-alive connection).

--levels sets the sweep's concurrency levels. The device is the server's (helios: [server] device):
the report records what a helios server says it serves on (/v1/models: device, CUDA graphs), and
--device D makes the run fail unless it serves on D (a server left on "auto" may be on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = (
    "river stone light market engine garden winter signal harbor paper mountain silver window story "
    "number forest candle bridge machine orange letter ocean thunder planet music shadow circle"
).split()
OUTPUT_TOKENS = 128
CONCURRENCY = (1, 4, 16, 32, 64)
BUSY = 32  # the "busy" scenario: this many concurrent short chats (where speculation must not cost)
SINGLE_PROMPTS, BUSY_PROMPTS = 900_000, 800_000  # the first short_chat index of these scenarios (concurrent)


def filler(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def short_chat(index: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {filler(6, index)}. Request {index}."}]


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0  # seconds to the first content token
    latency: float = 0.0
    tokens: int = 0  # completion tokens (usage when reported, else content chunks)
    prompt_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks
    error: str = ""
    retried: bool = False  # sent again once after the connection dropped before any response


async def one_request(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.2,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "seed": 1,
    }
    start = time.perf_counter()
    sample = Sample(ok=False)
    last = None
    chunks = 0
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                answered = True
                if response.status_code != 200:
                    sample.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return sample
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    if data.get("usage"):
                        sample.tokens = data["usage"].get("completion_tokens", 0)
                        sample.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                    for choice in data.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            now = time.perf_counter()
                            if last is None:
                                sample.ttft = now - start
                            else:
                                sample.gaps.append(now - last)
                            last = now
                            chunks += 1
            break
        except httpx.RemoteProtocolError as exc:
            # A pooled keep-alive connection the server had already closed drops the request before
            # any response: a client sends it again (once) on a fresh connection; its wait counts.
            if answered or attempt:
                sample.error = repr(exc)
                return sample
            sample.retried = True
        except httpx.HTTPError as exc:
            sample.error = repr(exc)
            return sample
    sample.latency = time.perf_counter() - start
    sample.tokens = sample.tokens or chunks
    sample.ok = True
    return sample


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.ok]
    gaps = [g for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "retried": sum(s.retried for s in samples),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1) if wall else 0.0,
        "requests_s": round(len(ok) / wall, 2) if wall else 0.0,
        "ttft_p50_ms": round(_percentile([s.ttft for s in ok], 0.5) * 1000, 1),
        "ttft_p99_ms": round(_percentile([s.ttft for s in ok], 0.99) * 1000, 1),
        "itl_p50_ms": round(_percentile(gaps, 0.5) * 1000, 2),
        "itl_p99_ms": round(_percentile(gaps, 0.99) * 1000, 2),
        "prompt_tokens": round(statistics.mean(s.prompt_tokens for s in ok)) if ok else 0,
        "first_error": next((s.error for s in samples if not s.ok), ""),
    }


async def concurrent(
    url: str, model: str, concurrency: int, rounds: int = 2, tokens: int = OUTPUT_TOKENS, first: int | None = None
) -> dict:
    """`concurrency` streams of short chats, `rounds` requests each. Their prompts are short_chat(first),
    short_chat(first + 1), ...; first defaults to 1000 x concurrency, so no two sweep levels (nor the
    single and busy scenarios, which pass their own) send the same chat: a server that drafts from
    earlier answers (helios' history drafts) would otherwise replay the previous level's outputs."""
    first = 1000 * concurrency if first is None else first
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, model, short_chat(-1), 8)  # warm-up
        slots = asyncio.Semaphore(concurrency)  # at most `concurrency` requests in flight

        async def limited(index: int) -> Sample:
            async with slots:
                return await one_request(client, url, model, short_chat(first + index), tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(limited(i) for i in range(concurrency * rounds)))
        return summarize(list(samples), time.perf_counter() - start)


async def single(url: str, model: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as client:
        before = await _speculation_counters(client, url)
    report = await concurrent(url, model, 1, rounds=3, first=SINGLE_PROMPTS)
    async with httpx.AsyncClient(timeout=60) as client:
        report.update(_speculation_delta(before, await _speculation_counters(client, url)))
    return report


async def prefix_reuse(url: str, model: str, turns: int = 4) -> dict:
    system = "You are a careful assistant. Reference notes: " + filler(1450, 7)  # ~1,500 tokens
    async with httpx.AsyncClient(timeout=600) as client:
        samples = []
        for turn in range(turns + 1):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {turn}: {filler(8, turn)}?"},
            ]
            samples.append(await one_request(client, url, model, messages, 8))
    cold, warm = samples[0], samples[1:]
    warm_ttft = statistics.median(s.ttft for s in warm if s.ok) if any(s.ok for s in warm) else 0.0
    return {
        "prompt_tokens": cold.prompt_tokens,
        "cold_ttft_ms": round(cold.ttft * 1000, 1),
        "warm_ttft_ms": round(warm_ttft * 1000, 1),
        "warm_over_cold": round(warm_ttft / cold.ttft, 3) if cold.ttft else None,
        "errors": sum(not s.ok for s in samples),
    }


async def prefill(url: str, model: str) -> dict:
    messages = [{"role": "user", "content": "Summarize: " + filler(1960, 11)}]  # ~2,000 tokens
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, model, [{"role": "user", "content": "hi"}], 1)
        samples = [
            await one_request(client, url, model, [{"role": "user", "content": f"{i} " + messages[0]["content"]}], 1)
            for i in range(3)
        ]
    ok = [s for s in samples if s.ok]
    best = min(ok, key=lambda s: s.latency) if ok else None
    return {
        "prompt_tokens": best.prompt_tokens if best else 0,
        "latency_ms": round(best.latency * 1000, 1) if best else None,
        "prefill_tok_s": round(best.prompt_tokens / best.latency, 1) if best and best.latency else 0.0,
        "errors": len(samples) - len(ok),
    }


EDIT_OUTPUT_TOKENS = 384


def source_file(lines: int = 300, seed: int = 5) -> str:
    """A deterministic ~`lines`-line Python module: small classes and functions with varied names."""
    rng = random.Random(seed)
    out = ['"""Inventory helpers."""', "", "from __future__ import annotations", "", "import math", ""]
    index = 0
    while len(out) < lines:
        noun, verb = rng.choice(WORDS), rng.choice(("load", "count", "merge", "score", "split", "price"))
        index += 1
        if index % 3 == 0:
            out += [
                "",
                f"class {noun.title()}{index}:",
                f'    """A {noun} record."""',
                "",
                "    def __init__(self, size: int, label: str) -> None:",
                "        self.size = size",
                "        self.label = label",
                "",
                f"    def {verb}(self, factor: float) -> float:",
                f"        return math.sqrt(self.size * factor) + {rng.randint(1, 99)}",
                "",
            ]
        else:
            out += [
                "",
                f"def {verb}_{noun}_{index}(items: list[int], limit: int = {rng.randint(2, 50)}) -> int:",
                f'    """{verb.title()} the {noun} items up to the limit."""',
                "    total = 0",
                "    for item in items[:limit]:",
                f"        total += item * {rng.randint(2, 9)}",
                "    return total",
                "",
            ]
    return "\n".join(out[:lines]) + "\n"


async def _speculation_counters(client: httpx.AsyncClient, url: str) -> dict | None:
    try:
        response = await client.get(url + "/metrics", params={"format": "json"})
        data = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) and "verification_rounds" in data else None


async def edit(url: str, model: str, requests: int = 2) -> dict:
    code = source_file()
    ask = (
        "Here is a Python file:\n\n```python\n" + code + "```\n\nReturn the whole file unchanged except that "
        'the docstring on the first line says "Inventory helpers for the warehouse." Reply with the file only.'
    )
    async with httpx.AsyncClient(timeout=1200) as client:
        await one_request(client, url, model, [{"role": "user", "content": "hi"}], 4)  # warm-up
        before = await _speculation_counters(client, url)
        start = time.perf_counter()
        samples = [
            await one_request(client, url, model, [{"role": "user", "content": ask}], EDIT_OUTPUT_TOKENS)
            for _ in range(requests)
        ]
        report = summarize(samples, time.perf_counter() - start)
        report.update(_speculation_delta(before, await _speculation_counters(client, url)))
    report["source_lines"] = code.count("\n")
    return report


def _speculation_delta(before: dict | None, after: dict | None) -> dict:
    """DEPTH (drafts per request round) and acceptance (accepted / drafted) between two snapshots."""
    if before is None or after is None:
        return {}
    delta = {k: after[k] - before[k] for k in ("verification_rounds", "verification_drafts", "accepted_drafts")}
    rounds, drafts = delta["verification_rounds"], delta["verification_drafts"]
    return {
        "depth": round(drafts / rounds, 2) if rounds else 0.0,
        "acceptance": round(delta["accepted_drafts"] / drafts, 3) if drafts else 0.0,
    }


async def served_on(url: str) -> dict | None:
    """The device and CUDA graphs a helios server reports in /v1/models (None from other servers)."""
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.get(url + "/v1/models")
            models = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    flare = (models or [{}])[0].get("flare") if isinstance(models, list) else None
    return {"device": flare.get("device"), "cuda_graphs": flare.get("cuda_graphs")} if isinstance(flare, dict) else None


async def run(url: str, model: str, scenarios: list[str], levels: tuple[int, ...] = CONCURRENCY) -> dict:
    report: dict = {"url": url, "server": await served_on(url)}
    if "single" in scenarios:
        report["single"] = await single(url, model)
    if "sweep" in scenarios:
        report["sweep"] = {str(c): await concurrent(url, model, c) for c in levels}
    if "prefix" in scenarios:
        report["prefix"] = await prefix_reuse(url, model)
    if "prefill" in scenarios:
        report["prefill"] = await prefill(url, model)
    if "edit" in scenarios:
        report["edit"] = await edit(url, model)
    if "busy" in scenarios:
        report["busy"] = await concurrent(url, model, BUSY, first=BUSY_PROMPTS)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--scenario", default="all", help="single, sweep, prefix, prefill, edit, busy or all (comma-separated)"
    )
    parser.add_argument("--levels", default=",".join(map(str, CONCURRENCY)), help="the sweep's concurrency levels")
    parser.add_argument("--device", help="fail unless the (helios) server reports serving on this device")
    parser.add_argument("--json")
    args = parser.parse_args()
    scenarios = ["single", "sweep", "prefix", "prefill", "edit"] if args.scenario == "all" else args.scenario.split(",")
    url = args.url.rstrip("/")
    if args.device is not None:
        server = asyncio.run(served_on(url))
        if server is None or server["device"] != args.device:
            raise SystemExit(f"--device {args.device}: the server at {url} reports serving on {server}")
    report = asyncio.run(run(url, args.model, scenarios, tuple(int(c) for c in args.levels.split(","))))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


__all__ = ["Sample", "asdict", "run"]

if __name__ == "__main__":
    main()
