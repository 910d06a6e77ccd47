"""Scale from zero: waiting requests, one scale write, bounded in number and time."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.engine.protocol.http import APIError
from kvfleet.gateway.activation import Activator

from .test_autoscaler import FakeScale as Scale


def test_waiting_requests_scale_from_zero_once_and_go_on_when_an_engine_is_ready() -> None:
    scale, ready = Scale(0), [False]
    activator = Activator(scale, lambda: ready[0], capacity=8, timeout_s=5, poll_s=0.01)

    async def scenario() -> None:
        waiting = [asyncio.create_task(activator.wait_for_replica()) for _ in range(5)]
        for _ in range(100):  # until every request waits and the scale was read (bounded)
            await asyncio.sleep(0.01)
            if activator.waiting == 5 and scale.writes:
                break
        await asyncio.sleep(0.05)  # more polls go by: still one write
        assert scale.writes == [1]  # five requests, one write
        assert activator.waiting == 5
        assert not any(task.done() for task in waiting)
        ready[0] = True  # the first engine passed its readiness probe
        await asyncio.wait_for(asyncio.gather(*waiting), 2)
        assert activator.waiting == 0

    asyncio.run(scenario())


def test_a_count_above_zero_is_never_touched() -> None:
    scale = Scale(2)  # engines starting after a rollout: wait, write nothing
    ready = [False]
    activator = Activator(scale, lambda: ready[0], capacity=8, timeout_s=5, poll_s=0.01)

    async def scenario() -> None:
        task = asyncio.create_task(activator.wait_for_replica())
        await asyncio.sleep(0.05)
        ready[0] = True
        await asyncio.wait_for(task, 2)

    asyncio.run(scenario())
    assert scale.writes == []


def test_too_many_waiting_or_too_long_is_503_with_retry_after() -> None:
    activator = Activator(Scale(0), lambda: False, capacity=2, timeout_s=0.2, poll_s=0.01)

    async def scenario() -> list[BaseException | None]:
        tasks = [asyncio.create_task(activator.wait_for_replica()) for _ in range(3)]
        return await asyncio.gather(*tasks, return_exceptions=True)  # type: ignore[return-value]

    results = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, APIError)]
    assert len(errors) == 3
    assert "already wait" in errors[2].message  # the third found the queue full at once
    assert all(e.status == 503 and e.headers["Retry-After"] for e in errors)
    assert "within 0.2 s" in errors[0].message
    with pytest.raises(APIError):
        asyncio.run(Activator(Scale(0), lambda: False, 0, 1).wait_for_replica())
