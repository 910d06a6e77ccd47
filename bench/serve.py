"""`kvfleet bench serve`: an online client for any OpenAI-compatible server (ours, vLLM, ...).

    kvfleet bench serve --base-url http://127.0.0.1:8000 --request-rate 4 \\
        --num-prompts 200 --input-len 1024 --output-len 256

Streams `/v1/completions` with prompts given as token ids (random, seeded; no tokenizer needed,
so a `--load-format dummy` server works) and `ignore_eos`, and records per request the time to
the first token (TTFT), the gaps between later chunks (ITL) and the total (e2e). Where the server
exports Prometheus metrics (ours, vLLM), the report's `engine` gives the means of its own
histograms over the measured requests (TTFT from the request's arrival in the engine to its
first token, the wait before it was first scheduled): the client's TTFT less the engine's is
HTTP and streaming.

Modes:
- `random`: Poisson arrivals at `--request-rate` (all at once if inf), capped by
  `--max-concurrency`.
- `shared-prefix`: `--num-prefixes` documents (one by default) of `--prefix-len` tokens, then
  `--num-prompts` questions of `--input-len` tokens, taking the documents in turn. One request
  primes each document first; the report covers the questions. Run it against a server with
  and without prefix caching, or a gateway with different routing policies, to compare.
- `blocker`: `--num-prompts` streams run twice, alone and then with one `--blocker-len`-token
  prompt arriving once they are all decoding; the report gives their ITL percentiles both times.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.bench.report import emit
from kvfleet.bench.workload import parse_range


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    e2e: float = 0.0
    started: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.started if self.chunk_times else 0.0

    @property
    def itl(self) -> list[float]:
        return [after - before for before, after in itertools.pairwise(self.chunk_times)]


class Client:
    def __init__(self, base_url: str, model: str, timeout: float) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/").removesuffix("/v1"),  # either form works
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.model = model

    async def complete(self, prompt: list[int], max_tokens: int) -> RequestResult:
        result = RequestResult(prompt_len=len(prompt))
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        began = time.perf_counter()
        result.started = began
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread())[:200]
                    result.error = f"HTTP {response.status_code}: {detail!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    now = time.perf_counter()
                    if payload.get("usage"):
                        result.output_tokens = payload["usage"]["completion_tokens"]
                    if payload.get("choices"):
                        result.chunk_times.append(now)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2e = time.perf_counter() - began
        result.ok = result.output_tokens == max_tokens
        if not result.ok:
            result.error = f"got {result.output_tokens} of {max_tokens} tokens"
        return result

    async def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 (a server may still be loading its model)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (await self.http.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready within {timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def histogram_totals(self) -> dict[str, tuple[float, float]]:
        """(sum, count) of each of ENGINE_HISTOGRAMS the server exports ({} where it exports
        none)."""
        try:
            response = await self.http.get("/metrics")
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        return histogram_totals(response.text)

    async def first_model(self) -> str:
        response = await self.http.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])

    async def close(self) -> None:
        await self.http.aclose()


# The engine's own histograms (seconds), as named without their prefix (kvfleet: or vllm:).
ENGINE_HISTOGRAMS = {
    "ttft_ms_mean": "time_to_first_token_seconds",
    "queue_ms_mean": "request_queue_time_seconds",
}


def histogram_totals(exposition: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ENGINE_HISTOGRAMS metric in a Prometheus text exposition, summed
    over its label sets, under our prefix or else vLLM's."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(exposition):
        prefix, _, name = family.name.partition(":")
        if prefix not in ("kvfleet", "vllm") or name not in ENGINE_HISTOGRAMS.values():
            continue
        key = f"{prefix}:{name}"
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                total = totals.setdefault(key, [0.0, 0.0])
                total[sample.name.endswith("_count")] += sample.value
    chosen = {}
    for name in ENGINE_HISTOGRAMS.values():
        found = totals.get(f"kvfleet:{name}") or totals.get(f"vllm:{name}")
        if found is not None:
            chosen[name] = (found[0], found[1])
    return chosen


def engine_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """The mean (ms) of each engine histogram over what it observed between two scrapes."""
    means = {}
    for key, name in ENGINE_HISTOGRAMS.items():
        if name in before and name in after:
            total = after[name][0] - before[name][0]
            count = after[name][1] - before[name][1]
            if count > 0:
                means[key] = round(total / count * 1e3, 2)
    return means


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 2)

    return {
        "mean": round(statistics.fmean(ordered) * scale, 2),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
    }


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in good)
    return {
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "elapsed_s": round(elapsed, 3),
        "request_throughput": round(len(good) / elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 1),
        "ttft_ms": _percentiles([r.ttft for r in good]),
        "itl_ms": _percentiles([gap for r in good for gap in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in good]),
    }


async def _run_batch(
    client: Client,
    requests: list[tuple[list[int], int]],
    rate: float,
    max_concurrency: int | None,
    rng: random.Random,
) -> tuple[list[RequestResult], float]:
    """Send `requests` with Poisson gaps at `rate` per second; wait for all of them."""
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def one(prompt: list[int], max_tokens: int) -> RequestResult:
        async with limit:
            return await client.complete(prompt, max_tokens)

    began = time.perf_counter()
    tasks = []
    for prompt, max_tokens in requests:
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - began


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(100, vocab_size - 100) for _ in range(n)]


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    vocab = args.vocab_size

    def request(prefix: list[int] | None = None) -> tuple[list[int], int]:
        prompt = (prefix or []) + _tokens(rng, rng.randint(*input_len), vocab)
        return prompt, rng.randint(*output_len)

    probe = Client(args.base_url, args.model or "", args.timeout)
    await probe.wait_ready(args.timeout)
    model = args.model or await probe.first_model()
    await probe.close()
    client = Client(args.base_url, model, args.timeout)
    report: dict[str, Any] = {
        "benchmark": "serve",
        "mode": args.mode,
        "base_url": args.base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
    }
    try:
        # Warm-up: compile kernels and capture graphs before anything is timed.
        await _run_batch(client, [request() for _ in range(2)], float("inf"), None, rng)
        if args.mode == "random":
            requests = [request() for _ in range(args.num_prompts)]
            before = await client.histogram_totals()
            results, elapsed = await _run_batch(
                client, requests, args.request_rate, args.max_concurrency, rng
            )
            report |= summarize(results, elapsed)
            report["engine"] = engine_means(before, await client.histogram_totals())
        elif args.mode == "shared-prefix":
            documents = [_tokens(rng, args.prefix_len, vocab) for _ in range(args.num_prefixes)]
            primers = [await client.complete(d + _tokens(rng, 8, vocab), 1) for d in documents]
            report["primer_ttft_ms"] = round(statistics.mean(p.ttft for p in primers) * 1e3, 2)
            report["prefix_len"] = args.prefix_len
            report["num_prefixes"] = args.num_prefixes
            # Questions take the documents in turn, so groups interleave.
            requests = [request(documents[i % len(documents)]) for i in range(args.num_prompts)]
            before = await client.histogram_totals()
            results, elapsed = await _run_batch(
                client, requests, args.request_rate, args.max_concurrency, rng
            )
            report |= summarize(results, elapsed)
            report["engine"] = engine_means(before, await client.histogram_totals())
        else:
            report |= await _blocker(client, args, request, rng)
    finally:
        await client.close()
    return report


async def _blocker(
    client: Client,
    args: argparse.Namespace,
    request: Callable[[], tuple[list[int], int]],
    rng: random.Random,
) -> dict[str, Any]:
    """The streams' ITL alone, then with one long prompt arriving while they all decode."""
    streams = [request() for _ in range(args.num_prompts)]
    alone, alone_s = await _run_batch(client, streams, float("inf"), None, rng)
    blocker_prompt = _tokens(rng, args.blocker_len, args.vocab_size)

    async def with_blocker() -> tuple[list[RequestResult], RequestResult, float]:
        began = time.perf_counter()
        tasks = [asyncio.create_task(client.complete(p, n)) for p, n in streams]
        # Send the blocker once the streams are decoding: when, in the run alone, a quarter of
        # their tokens were out.
        await asyncio.sleep(_time_to_tokens(alone, min(n for _, n in streams) // 4))
        blocker = await client.complete(blocker_prompt, 16)
        results = list(await asyncio.gather(*tasks))
        return results, blocker, time.perf_counter() - began

    results, blocker, both_s = await with_blocker()
    alone_summary, both_summary = summarize(alone, alone_s), summarize(results, both_s)
    return {
        "blocker_len": args.blocker_len,
        "alone": alone_summary,
        "with_blocker": both_summary,
        "blocker_ttft_ms": round(blocker.ttft * 1e3, 2),
        "blocker_ok": blocker.ok,
        "itl_during_blocker_prefill_ms": _percentiles(_gaps_during(results, blocker)),
        "itl_p99_ratio": _ratio(both_summary["itl_ms"], alone_summary["itl_ms"]),
    }


def _time_to_tokens(results: list[RequestResult], tokens: int) -> float:
    """Median time from start to the `tokens`-th chunk in a finished run."""
    times = [r.chunk_times[tokens] - r.started for r in results if len(r.chunk_times) > tokens]
    return statistics.median(times) if times else 0.5


def _gaps_during(results: list[RequestResult], blocker: RequestResult) -> list[float]:
    """Gaps of the streams that overlap the blocker's prefill (its send to its first token)."""
    start, end = blocker.started, blocker.started + blocker.ttft
    gaps = []
    for r in results:
        for before, after in itertools.pairwise(r.chunk_times):
            if after >= start and before <= end:
                gaps.append(after - before)
    return gaps


def _ratio(with_blocker: dict[str, float], alone: dict[str, float]) -> float | None:
    if not with_blocker or not alone or not alone.get("p99"):
        return None
    return round(with_blocker["p99"] / alone["p99"], 2)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = asyncio.run(_main(args))
    emit(report, args.json)
    failed = report.get("failed", 0) or report.get("with_blocker", {}).get("failed", 0)
    return 1 if failed else 0
