"""route(): prefix first within the imbalance bound, LoRA affinity, sessions, the other policies."""

from __future__ import annotations

import pytest

from kvfleet.engine.protocol.kv import hash_full_blocks
from kvfleet.gateway.routing.policy import NoReplicaError, route
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import (
    ClusterSnapshot,
    Policy,
    ReplicaId,
    ReplicaState,
    RouteConfig,
    RouteRequest,
)

DOC = tuple(hash_full_blocks(list(range(80)), 16))  # 5 blocks
PREFIX = RouteConfig(Policy.PREFIX, max_imbalance=4)


def replica(name: str, running: int = 0, ready: bool = True, **extra: object) -> ReplicaState:
    return ReplicaState(ReplicaId(name), ready, num_running=running, **extra)  # type: ignore[arg-type]


def indexed(**held: int) -> PrefixIndex:
    """Replica name -> how many leading DOC blocks it holds."""
    index = PrefixIndex()
    for name, count in held.items():
        index.load_snapshot(ReplicaId(name), DOC[:count], seq=0)
    return index


def test_prefix_picks_the_longest_match() -> None:
    snapshot = ClusterSnapshot((replica("a"), replica("b", running=2), replica("c")))
    decision = route(RouteRequest(DOC), snapshot, indexed(a=1, b=4, c=0), PREFIX)
    assert (decision.replica_id, decision.reason, decision.prefix_blocks) == ("b", "prefix", 4)


def test_imbalance_guard_falls_back_to_least_loaded() -> None:
    snapshot = ClusterSnapshot((replica("a", running=1), replica("b", running=6)))
    index = indexed(a=0, b=5)
    decision = route(RouteRequest(DOC), snapshot, index, PREFIX)
    assert (decision.replica_id, decision.reason) == ("a", "imbalance")
    at_bound = ClusterSnapshot((replica("a", running=1), replica("b", running=5)))
    assert route(RouteRequest(DOC), at_bound, index, PREFIX).replica_id == "b"


def test_new_prefixes_spread_over_the_idle_replicas_and_ties_break_by_id() -> None:
    snapshot = ClusterSnapshot((replica("b"), replica("a"), replica("c", running=1)))
    decision = route(RouteRequest(DOC), snapshot, indexed(), PREFIX)
    assert decision.reason == "least-load"
    assert decision.replica_id in ("a", "b")  # never the busier c
    documents = [tuple(hash_full_blocks(list(range(n, n + 32)), 16)) for n in range(0, 3200, 100)]
    picks = [route(RouteRequest(d), snapshot, indexed(), PREFIX).replica_id for d in documents]
    assert set(picks) == {"a", "b"}  # spread, not piled onto "a"
    again = [route(RouteRequest(d), snapshot, indexed(), PREFIX).replica_id for d in documents]
    assert again == picks
    short = route(RouteRequest(()), snapshot, indexed(), PREFIX)  # no full block: by id
    assert (short.replica_id, short.reason) == ("a", "least-load")
    tie = route(RouteRequest(DOC), snapshot, indexed(a=3, b=3), PREFIX)
    assert (tie.replica_id, tie.reason) == ("a", "prefix")


def test_only_ready_replicas_and_none_ready_raises() -> None:
    snapshot = ClusterSnapshot((replica("a", ready=False), replica("b")))
    assert route(RouteRequest(DOC), snapshot, indexed(a=5), PREFIX).replica_id == "b"
    with pytest.raises(NoReplicaError):
        route(RouteRequest(DOC), ClusterSnapshot((replica("a", ready=False),)), indexed(), PREFIX)


def test_lora_affinity_and_loading_onto_the_least_loaded() -> None:
    snapshot = ClusterSnapshot(
        (replica("a", adapters=frozenset({"sql"})), replica("b", running=3), replica("c"))
    )
    held = route(RouteRequest(DOC, adapter="sql"), snapshot, indexed(c=5), PREFIX)
    assert (held.replica_id, held.load_adapter) == ("a", False)  # affinity beats the prefix
    missing = route(RouteRequest(DOC, adapter="poet"), snapshot, indexed(c=5), PREFIX)
    assert (missing.replica_id, missing.reason, missing.load_adapter) == ("a", "adapter-load", True)


def test_session_affinity_is_stable_and_moves_only_when_its_replica_leaves() -> None:
    three = ClusterSnapshot((replica("a"), replica("b"), replica("c")))
    sessions = [f"user-{i}" for i in range(60)]
    first = {s: route(RouteRequest(DOC, session_id=s), three, indexed(), PREFIX) for s in sessions}
    assert {d.reason for d in first.values()} == {"session"}
    assert {d.replica_id for d in first.values()} == {"a", "b", "c"}  # spread over all
    b_down = ClusterSnapshot((replica("a"), replica("b", ready=False), replica("c")))
    for session, decision in first.items():
        again = route(RouteRequest(DOC, session_id=session), b_down, indexed(), PREFIX)
        if decision.replica_id != "b":
            assert again.replica_id == decision.replica_id


def test_round_robin_and_least_load_policies() -> None:
    snapshot = ClusterSnapshot((replica("a"), replica("b", running=1)))
    robin = RouteConfig(Policy.ROUND_ROBIN)
    picks = [route(RouteRequest(DOC), snapshot, indexed(), robin, i).replica_id for i in range(4)]
    assert picks == ["a", "b", "a", "b"]
    least = route(RouteRequest(DOC), snapshot, indexed(b=5), RouteConfig(Policy.LEAST_LOAD))
    assert (least.replica_id, least.reason, least.prefix_blocks) == ("a", "least-load", 0)


def test_two_gateways_with_the_same_view_route_identically() -> None:
    def view() -> tuple[ClusterSnapshot, PrefixIndex]:
        snapshot = ClusterSnapshot(
            (replica("b", running=1), replica("a", running=2), replica("c", running=1))
        )
        return snapshot, indexed(a=2, b=2, c=4)

    requests = [RouteRequest(DOC[:n]) for n in range(1, 6)] + [RouteRequest(DOC, session_id="s")]
    first, second = view(), view()
    assert [route(r, *first, PREFIX) for r in requests] == [
        route(r, *second, PREFIX) for r in requests
    ]
