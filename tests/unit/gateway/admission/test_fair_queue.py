"""FairQueue: priority first, fair turns between keys, no banked credit, deadlines, bounds."""

from __future__ import annotations

import pytest

from kvfleet.gateway.admission.fair_queue import FairQueue, QueueFull
from kvfleet.gateway.admission.rate_limit import KeyId

A, B, C = KeyId("a"), KeyId("b"), KeyId("c")
FAR = 1e9


def drain(queue: FairQueue[str], now: float = 0.0) -> list[str]:
    served = []
    while True:
        item, _ = queue.pop(now)
        if item is None:
            return served
        served.append(item)


def test_two_keys_with_ten_to_one_demand_alternate() -> None:
    queue: FairQueue[str] = FairQueue(capacity=100)
    for i in range(20):
        queue.push(A, f"a{i}", FAR)
    for i in range(2):
        queue.push(B, f"b{i}", FAR)
    served = drain(queue)
    assert served[:4] == ["a0", "b0", "a1", "b1"]
    assert served[4:] == [f"a{i}" for i in range(2, 20)]


def test_weights_share_turns_in_proportion() -> None:
    queue: FairQueue[str] = FairQueue(capacity=100, weights={A: 3.0})
    for i in range(9):
        queue.push(A, f"a{i}", FAR)
        queue.push(B, f"b{i}", FAR)
    first_eight = drain(queue)[:8]
    assert sum(x.startswith("a") for x in first_eight) == 6


def test_priority_classes_go_first() -> None:
    queue: FairQueue[str] = FairQueue(capacity=10)
    queue.push(A, "normal", FAR, priority=0)
    queue.push(B, "urgent", FAR, priority=-1)
    queue.push(C, "batch", FAR, priority=5)
    assert drain(queue) == ["urgent", "normal", "batch"]


def test_an_idle_key_does_not_bank_credit() -> None:
    queue: FairQueue[str] = FairQueue(capacity=100)
    for i in range(5):
        queue.push(A, f"a{i}", FAR)
    assert drain(queue) == [f"a{i}" for i in range(5)]  # only A was waiting
    for i in range(3):
        queue.push(A, f"a{5 + i}", FAR)
        queue.push(B, f"b{i}", FAR)
    # B was idle during A's run: it starts at the current virtual time, one turn ahead of A
    # (A just used the service), then they alternate; no burst of five for B.
    assert drain(queue) == ["b0", "a5", "b1", "a6", "b2", "a7"]


def test_deadlines_bound_and_removal() -> None:
    queue: FairQueue[str] = FairQueue(capacity=3)
    queue.push(A, "late", deadline=5.0)
    queue.push(B, "fine", deadline=50.0)
    gone = "gone"
    queue.push(C, gone, deadline=50.0)
    with pytest.raises(QueueFull):
        queue.push(A, "extra", FAR)
    assert queue.remove(gone)
    assert not queue.remove(gone)
    item, expired = queue.pop(now=10.0)
    assert (item, expired) == ("fine", ["late"])
    assert len(queue) == 0
    assert queue.pop(now=10.0) == (None, [])
    with pytest.raises(ValueError, match="capacity"):
        FairQueue(capacity=0)
