"""How much one client's expensive, doomed requests delay everybody else's ordinary chats.

    python benchmarks/hostile_bench.py http://127.0.0.1:8000 [--bodies 4] [--messages 400000] [--json out.json]

Sends `--bodies` adversarial Chat bodies at once (each ~13 MB: 400,000 short messages that
can never fit the context) and, while they are in flight, ordinary short chats one after
another. Reports the ordinary chats' latency alone and under that load, and how the
adversarial requests were answered (they must get 400, quickly). Run it on a quiet
machine against a server started alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

ORDINARY = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}


def adversarial_body(messages: int) -> bytes:
    return json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"m{i}"} for i in range(messages)]}
    ).encode()


async def ordinary_latencies(client: httpx.AsyncClient, url: str, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        response = await client.post(url + "/v1/chat/completions", json=ORDINARY)
        response.raise_for_status()
        latencies.append(time.perf_counter() - start)
    return latencies


async def run(url: str, bodies: int, messages: int, key: str | None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = adversarial_body(messages)
    async with httpx.AsyncClient(timeout=300, headers=headers, limits=httpx.Limits(max_connections=64)) as client:
        await ordinary_latencies(client, url, 3)  # warm up
        alone = await ordinary_latencies(client, url, 10)

        async def hostile() -> tuple[int, float]:
            start = time.perf_counter()
            response = await client.post(
                url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            return response.status_code, time.perf_counter() - start

        attacks = [asyncio.create_task(hostile()) for _ in range(bodies)]
        await asyncio.sleep(0.05)  # the bodies are on their way
        loaded = await ordinary_latencies(client, url, 10)
        answers = await asyncio.gather(*attacks)
    return {
        "body_megabytes": round(len(body) / 1e6, 1),
        "bodies": bodies,
        "ordinary_alone_p50_s": round(statistics.median(alone), 3),
        "ordinary_under_load_p50_s": round(statistics.median(loaded), 3),
        "ordinary_under_load_max_s": round(max(loaded), 3),
        "adversarial_statuses": sorted({status for status, _ in answers}),
        "adversarial_max_s": round(max(seconds for _, seconds in answers), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--bodies", type=int, default=4)
    parser.add_argument("--messages", type=int, default=400_000)
    parser.add_argument("--key", default=None)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    result = asyncio.run(run(args.url.rstrip("/"), args.bodies, args.messages, args.key))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
