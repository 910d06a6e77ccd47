"""PrefixIndex: snapshot + events in sequence, gaps and breaks, the approximate fallback."""

from __future__ import annotations

import pytest

from kvfleet.engine.protocol.kv import hash_full_blocks
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
DOC = hash_full_blocks(list(range(64)), 16)  # 4 blocks
OTHER = hash_full_blocks(list(range(100, 164)), 16)


def test_snapshot_then_events_in_sequence() -> None:
    index = PrefixIndex()
    index.load_snapshot(A, DOC[:2], seq=10)
    assert index.match(A, DOC) == 2
    assert index.apply_event(A, 11, "stored", DOC[2])
    assert index.apply_event(A, 12, "stored", DOC[3])
    assert index.match(A, DOC) == 4
    assert index.apply_event(A, 13, "removed", DOC[1])
    assert index.match(A, DOC) == 1  # leading blocks only: block 1 is gone
    assert index.apply_event(A, 10, "removed", DOC[0])  # already in the snapshot: ignored
    assert index.match(A, DOC) == 1
    assert index.apply_event(A, 14, "cleared", None)
    assert index.match(A, DOC) == 0
    assert index.match(B, DOC) == 0  # unknown replica


def test_a_gap_marks_the_replica_stale_until_a_new_snapshot() -> None:
    index = PrefixIndex()
    index.load_snapshot(A, DOC, seq=0)
    assert not index.apply_event(A, 2, "removed", DOC[0])  # seq 1 is missing
    assert not index.is_live(A)
    assert not index.apply_event(A, 3, "stored", OTHER[0])
    assert index.match(A, DOC) == 4  # answered from the approximation seeded at the gap
    index.load_snapshot(A, OTHER[:1], seq=3)
    assert index.is_live(A)
    assert index.match(A, DOC) == 0
    assert index.match(A, OTHER) == 1


def test_approximate_index_from_routing_is_bounded_lru() -> None:
    index = PrefixIndex(approximate_capacity=6)
    index.mark_stale(A)  # never had a stream
    index.record_route(A, DOC)
    assert index.match(A, DOC) == 4
    index.record_route(A, OTHER[:2])  # 6 blocks now, at capacity
    index.record_route(A, OTHER[2:3])  # evicts the least recently routed block: DOC[0]
    assert index.match(A, DOC) == 0
    assert index.match(A, OTHER) == 3


def test_bad_events_are_refused() -> None:
    index = PrefixIndex()
    index.load_snapshot(A, [], seq=0)
    with pytest.raises(ValueError, match="needs a block hash"):
        index.apply_event(A, 1, "stored", None)
    with pytest.raises(ValueError, match="unknown KV event"):
        index.apply_event(A, 1, "moved", DOC[0])
    with pytest.raises(ValueError, match="approximate_capacity"):
        PrefixIndex(approximate_capacity=0)
