"""route(): pick the replica for one request from a cluster snapshot and the prefix index.

Order of concerns: only ready replicas; a LoRA request prefers replicas that hold its adapter
(else the least-loaded replica, which must load it first); a session id sticks to one replica
by rendezvous hashing (the same on every gateway); then the policy. `prefix` takes the replica
holding the most leading prompt blocks, unless it is more than `max_imbalance` requests busier
than the least-loaded one; a prompt no replica holds goes to a replica about as idle as the
least-loaded one, chosen by hashing its first block (so documents spread). Ties break by load,
then replica id: two gateways with the same snapshot and index make the same choice.
"""

from __future__ import annotations

import hashlib

from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import (
    ClusterSnapshot,
    Policy,
    ReplicaState,
    RouteConfig,
    RouteDecision,
    RouteRequest,
)


class NoReplicaError(LookupError):
    """No replica is ready (the gateway answers 503)."""


def route(
    request: RouteRequest,
    snapshot: ClusterSnapshot,
    index: PrefixIndex,
    config: RouteConfig,
    round_robin_position: int = 0,
) -> RouteDecision:
    ready = snapshot.ready
    if not ready:
        raise NoReplicaError("no engine replica is ready")
    if request.adapter is not None:
        holding = [r for r in ready if request.adapter in r.adapters]
        if not holding:
            target = _least_loaded(ready)
            blocks = index.match(target.replica_id, request.block_hashes)
            return RouteDecision(target.replica_id, "adapter-load", blocks, load_adapter=True)
        ready = holding
    target, reason = _pick(request, ready, index, config, round_robin_position)
    return RouteDecision(
        target.replica_id, reason, index.match(target.replica_id, request.block_hashes)
    )


def _pick(
    request: RouteRequest,
    ready: list[ReplicaState],
    index: PrefixIndex,
    config: RouteConfig,
    round_robin_position: int,
) -> tuple[ReplicaState, str]:
    if request.session_id is not None:
        session = request.session_id
        return max(ready, key=lambda r: _rendezvous(session, r)), "session"
    if config.policy is Policy.ROUND_ROBIN:
        return ready[round_robin_position % len(ready)], "round-robin"
    least = _least_loaded(ready)
    if config.policy is Policy.LEAST_LOAD:
        return least, "least-load"
    matches = {r.replica_id: index.match(r.replica_id, request.block_hashes) for r in ready}
    best = min(ready, key=lambda r: (-matches[r.replica_id], r.load, r.replica_id))
    if matches[best.replica_id] == 0:
        return _new_prefix(request, ready, least), "least-load"
    if best.load - least.load > config.max_imbalance:
        return least, "imbalance"
    return best, "prefix"


def _new_prefix(
    request: RouteRequest, ready: list[ReplicaState], least: ReplicaState
) -> ReplicaState:
    """A prompt no replica holds: among the replicas about as idle as the least-loaded one,
    the one its first block hashes to, so new documents spread over replicas (and every
    gateway picks the same one) instead of piling onto the first replica by id."""
    if not request.block_hashes:
        return least
    calm = [r for r in ready if r.load - least.load < 1.0]
    first = request.block_hashes[0].hex()
    return max(calm, key=lambda r: _rendezvous(first, r))


def _least_loaded(replicas: list[ReplicaState]) -> ReplicaState:
    return min(replicas, key=lambda r: (r.load, r.replica_id))


def _rendezvous(session_id: str, replica: ReplicaState) -> bytes:
    """Highest-random-weight hashing: a session keeps its replica while that one is ready, and
    only the sessions of a replica that leaves move."""
    return hashlib.sha256(f"{session_id}\x00{replica.replica_id}".encode()).digest()
