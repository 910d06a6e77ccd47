"""BodyWork: small bodies in a thread with this process's tokenizer, large ones in a worker
process with its own; errors cross back whole; a flood of large bodies is refused, not queued."""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import time

import pytest

from kvfleet.engine.protocol import body_work as body_limit
from kvfleet.engine.protocol.body_work import LARGE_BODY_BYTES, BodyWork
from kvfleet.engine.protocol.http import APIError
from kvfleet.engine.server.requests import read_completion


def test_small_bodies_run_here_and_large_ones_in_the_worker() -> None:
    async def main() -> None:
        work = BodyWork({"where": "here"}, functools.partial(dict, where="worker"))
        try:
            small = await work.run(100, operator.getitem, "where")
            large = await work.run(LARGE_BODY_BYTES, operator.getitem, "where")
        finally:
            work.close()
        assert (small, large) == ("here", "worker")

    asyncio.run(main())


def test_a_large_body_is_read_in_the_worker_and_its_errors_come_back_whole() -> None:
    ids = list(range(1, 40_000))
    raw = json.dumps({"model": "m", "prompt": ids, "max_tokens": 3}).encode()
    text = json.dumps({"model": "m", "prompt": "x" * 200_000}).encode()
    assert len(raw) >= LARGE_BODY_BYTES
    assert len(text) >= LARGE_BODY_BYTES

    async def main() -> None:
        work: BodyWork[None] = BodyWork(None, None)
        try:
            req, prompts = await work.run(len(raw), read_completion, raw)
            assert prompts == [ids]
            assert (req.max_tokens, req.prompt) == (3, "")  # the prompt rides as token ids
            with pytest.raises(APIError) as refused:
                await work.run(len(text), read_completion, text)
        finally:
            work.close()
        assert refused.value.status == 400
        assert "no tokenizer" in refused.value.message

    asyncio.run(main())


def test_a_flood_of_large_bodies_is_refused_beyond_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(body_limit, "MAX_LARGE_BODIES", 2)

    async def main() -> list[object]:
        # the worker's "tokenizer" is 0.5: each body's work sleeps that long there
        work = BodyWork(None, functools.partial(float, "0.5"))
        try:
            await work.run(LARGE_BODY_BYTES, time.sleep)  # started, and warm
            return await asyncio.gather(
                *(work.run(LARGE_BODY_BYTES, time.sleep) for _ in range(3)),
                return_exceptions=True,
            )
        finally:
            work.close()

    results = asyncio.run(main())
    assert results[:2] == [None, None]
    refused = results[2]
    assert isinstance(refused, APIError)
    assert (refused.status, refused.code) == (503, "overloaded")
