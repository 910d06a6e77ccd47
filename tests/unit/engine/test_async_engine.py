"""AsyncEngine counts a request's queue time and TTFT from when the server received it: a
request that arrives while the engine thread is busy (a step, here a held command) waits
for it, and that wait is in its metrics, as vLLM's are (its API server stamps arrival)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.async_engine import AsyncEngine

HfModelDir = Callable[[str], tuple[Any, Path]]
BUSY_S = 0.3


def _first_output(engine: AsyncEngine, arrival_time: float | None) -> RequestOutput:
    """The first output of a request queued at `arrival_time` while the engine thread is
    held for BUSY_S."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(BUSY_S)

    async def run() -> RequestOutput:
        busy = asyncio.ensure_future(engine._call(hold))
        await asyncio.to_thread(held.wait, 10)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        stream = await engine.generate(
            f"r{arrival_time}", [5, 6, 7, 8], params, arrival_time=arrival_time
        )
        first = await anext(stream)
        async for _ in stream:
            pass
        await busy
        return first

    return asyncio.run(run())


def test_queue_time_and_ttft_count_from_the_arrival_the_server_stamped(
    hf_model_dir: HfModelDir,
) -> None:
    _, folder = hf_model_dir("llama2-tied")
    core = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=128,
            cache=CacheConfig(block_size=16, num_blocks=32),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        )
    )
    engine = AsyncEngine(core)
    engine.start()
    try:
        arrived = time.monotonic()
        stamped = _first_output(engine, arrived).metrics
        assert stamped.arrival_time == arrived
        assert stamped.queue_time is not None
        assert stamped.queue_time >= BUSY_S
        assert stamped.time_to_first_token is not None
        assert stamped.time_to_first_token >= stamped.queue_time
        # Without a stamp the clock starts when the engine thread takes the request.
        unstamped = _first_output(engine, None).metrics
        assert unstamped.queue_time is not None
        assert unstamped.queue_time < BUSY_S
    finally:
        asyncio.run(engine.shutdown(timeout_s=1))
