"""The plain data routing works on: replicas as last seen, one request, one decision."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

from kvfleet.engine.protocol.kv import BlockHash

ReplicaId = NewType("ReplicaId", str)


class Policy(enum.Enum):
    PREFIX = "prefix"  # most leading prompt blocks cached, within the imbalance bound
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ReplicaState:
    """One engine replica as the gateway last saw it (health, /metrics, its own in-flight)."""

    replica_id: ReplicaId
    ready: bool
    kv_cache_usage: float = 0.0  # 0..1
    num_running: int = 0
    num_waiting: int = 0
    # Requests this gateway sent (+1) and saw finish (-1) since the replica's last metrics
    # reading: a request counted as running in that reading leaves the queue when it ends,
    # not at the next reading. Negative when more finished than started.
    num_in_flight: int = 0
    num_finished: float = 0.0  # requests the replica finished since it started (a counter)
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded there

    @property
    def load(self) -> float:
        """Queue depth, in requests, plus the KV cache's fill as a tie-breaker below one."""
        queued = self.num_running + self.num_waiting + self.num_in_flight
        return max(0, queued) + self.kv_cache_usage


@dataclass(frozen=True)
class ClusterSnapshot:
    replicas: tuple[ReplicaState, ...]

    @property
    def ready(self) -> list[ReplicaState]:
        """Ready replicas in a fixed order (by id), so every gateway sees the same list."""
        return sorted((r for r in self.replicas if r.ready), key=lambda r: r.replica_id)


@dataclass(frozen=True)
class RouteRequest:
    block_hashes: tuple[BlockHash, ...]  # the prompt's full blocks, hashed as the engines do
    adapter: str | None = None  # LoRA adapter the request names; None: the base model
    session_id: str | None = None  # session-affinity header


@dataclass(frozen=True)
class RouteConfig:
    policy: Policy = Policy.PREFIX
    # The prefix policy may pick a replica at most this much busier (in requests) than the
    # least-loaded one; beyond, the least-loaded replica wins.
    max_imbalance: float = 8.0


@dataclass(frozen=True)
class RouteDecision:
    replica_id: ReplicaId
    reason: str  # "prefix", "least-load", "round-robin", "session", "imbalance", "adapter-load"
    prefix_blocks: int = 0  # leading prompt blocks the chosen replica holds
    load_adapter: bool = False  # the adapter must be loaded there first
