"""Hostile load against a running server (an engine or a gateway): what it costs the others.

    python -m kvfleet.bench.hostile large-body --base-url http://127.0.0.1:8000 --model smollm2
    python -m kvfleet.bench.hostile burst --base-url http://127.0.0.1:8000 --model smollm2 \\
        --num-streams 500

- `large-body`: one stream decodes (`--stream-tokens`, ignore_eos); a second into it a chat body
  of `--messages` one-word messages (~4 MB for 100,000) is posted. Reports the stream's median
  gap between tokens, the largest gap while the body was being worked on, and the delay (the
  difference). The body's own answer is a 400 (its prompt is over any context).
- `burst`: `--num-streams` chat streams sent at once (1 ms apart, in order). Reports, by arrival
  order, the time to first token of the first `--first` and of all, and their ends: under
  overload the earliest should start within a few engine steps and finish first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import httpx

from kvfleet.bench.report import emit


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], path: str
) -> tuple[int, list[float]]:
    """(status, arrival time of each chunk with text) of one streamed request."""
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:]).get("choices", [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    return r.status_code, times


async def large_body(args: argparse.Namespace) -> dict[str, Any]:
    url = args.base_url.rstrip("/")
    messages = [{"role": "user", "content": "word"}] * args.messages
    raw = json.dumps({"model": args.model, "messages": messages, "max_tokens": 4}).encode()
    stream_body = {
        "model": args.model,
        "prompt": "Count to one thousand:",
        "max_tokens": args.stream_tokens,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=600) as client:
        streaming = asyncio.create_task(_stream(client, url, stream_body, "completions"))
        await asyncio.sleep(args.delay_s)
        sent = time.perf_counter()
        big = await client.post(
            f"{url}/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        answered = time.perf_counter()
        status, times = await streaming
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    during = [g for g, at in gaps if sent <= at <= answered + max(g for g, _ in gaps)]
    median = statistics.median(g for g, _ in gaps)
    worst = max(during) if during else 0.0
    return {
        "body_bytes": len(raw),
        "body_status": big.status_code,
        "body_seconds": round(answered - sent, 3),
        "stream_status": status,
        "stream_tokens": len(times),
        "median_gap_ms": round(1000 * median, 1),
        "max_gap_during_body_ms": round(1000 * worst, 1),
        "delay_ms": round(1000 * (worst - median), 1),
    }


async def burst(args: argparse.Namespace) -> dict[str, Any]:
    url = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.num_streams + 10)
    results: dict[int, tuple[int, list[float]]] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
        }
        results[i] = await _stream(client, url, body, "chat/completions")

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i in range(args.num_streams):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
    ok = [i for i in range(args.num_streams) if results[i][0] == 200 and results[i][1]]
    ttft = {i: results[i][1][0] - start for i in ok}
    end = {i: results[i][1][-1] - start for i in ok}
    gaps = [b - a for i in ok for a, b in zip(results[i][1], results[i][1][1:], strict=False)]
    first = [i for i in ok if i < args.first]
    step = statistics.median(gaps) if gaps else float("nan")
    return {
        "streams": args.num_streams,
        "answered": len(ok),
        "median_gap_s": round(step, 3),
        "first_ttft_max_s": round(max(ttft[i] for i in first), 2),
        "first_ttft_max_in_steps": round(max(ttft[i] for i in first) / step, 1),
        "first_end_p50_s": round(statistics.median(end[i] for i in first), 2),
        "ttft_p50_s": round(statistics.median(ttft.values()), 2),
        "ttft_max_s": round(max(ttft.values()), 2),
        "end_p50_s": round(statistics.median(end.values()), 2),
        "end_max_s": round(max(end.values()), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["large-body", "burst"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--delay-s", type=float, default=1.0)
    parser.add_argument("--num-streams", type=int, default=500)
    parser.add_argument("--first", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", help="also write the JSON result here")
    args = parser.parse_args()
    run = large_body if args.mode == "large-body" else burst
    emit({"mode": args.mode, **asyncio.run(run(args))}, args.output)


if __name__ == "__main__":
    main()
