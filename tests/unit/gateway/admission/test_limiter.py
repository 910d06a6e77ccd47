"""ConcurrencyGate: slots, fair hand-over between keys, queue bound, timeout, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet.gateway.admission.limiter import ConcurrencyGate, QueueFull, QueueTimeout
from kvfleet.gateway.admission.rate_limit import KeyId

pytestmark = pytest.mark.asyncio
A, B = KeyId("a"), KeyId("b")


def make_gate(capacity: int = 1, queue: int = 100) -> ConcurrencyGate:
    return ConcurrencyGate(lambda: capacity, queue, {}, time.monotonic)


async def test_waiters_get_slots_in_fair_order() -> None:
    gate = make_gate(capacity=1)
    await gate.acquire(A, 0, 5)  # the one slot is taken
    order: list[str] = []

    async def request(key: KeyId, name: str) -> None:
        await gate.acquire(key, 0, 5)
        order.append(name)
        await asyncio.sleep(0)
        gate.release()

    tasks = [asyncio.create_task(request(A, f"a{i}")) for i in range(6)]
    tasks += [asyncio.create_task(request(B, f"b{i}")) for i in range(2)]
    await asyncio.sleep(0)  # all queued
    gate.release()
    await asyncio.gather(*tasks)
    assert order[:4] == ["a0", "b0", "a1", "b1"]
    assert gate.in_flight == 0


async def test_queue_bound_and_timeout() -> None:
    gate = make_gate(capacity=1, queue=1)
    await gate.acquire(A, 0, 5)
    waiting = asyncio.create_task(gate.acquire(A, 0, 0.05))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await gate.acquire(B, 0, 5)
    with pytest.raises(QueueTimeout):
        await waiting
    assert len(gate.queue) == 0
    gate.release()
    assert gate.in_flight == 0


async def test_a_cancelled_waiter_frees_its_place_and_slot() -> None:
    gate = make_gate(capacity=1)
    await gate.acquire(A, 0, 5)
    gone = asyncio.create_task(gate.acquire(A, 0, 5))
    stays = asyncio.create_task(gate.acquire(B, 0, 5))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    gate.release()
    await stays  # got the slot the cancelled one would have had
    assert gate.in_flight == 1
    gate.release()
    assert gate.in_flight == 0
