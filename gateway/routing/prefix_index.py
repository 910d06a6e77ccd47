"""PrefixIndex: which prompt blocks each replica holds, mirrored from the engines' KV events.

Exact while a replica's event stream is live: a snapshot, then events applied in sequence. A
gap in sequence numbers or a broken stream marks the replica stale until the caller loads a
new snapshot; meanwhile the index answers from an approximate record of the blocks of requests
recently routed there (bounded, least recently routed dropped first). Every gateway building
its index from the same engines' snapshots and events holds the same exact view.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet.engine.protocol.kv import BlockHash
from kvfleet.gateway.routing.snapshot import ReplicaId


@dataclass
class _Replica:
    blocks: set[BlockHash] = field(default_factory=set)
    last_seq: int | None = None  # None: no snapshot yet, or stale since a gap or a break
    approximate: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)


class PrefixIndex:
    def __init__(self, approximate_capacity: int = 65536) -> None:
        if approximate_capacity < 1:
            raise ValueError(f"approximate_capacity must be >= 1, got {approximate_capacity}")
        self.approximate_capacity = approximate_capacity
        self._replicas: dict[ReplicaId, _Replica] = {}

    def is_live(self, replica_id: ReplicaId) -> bool:
        replica = self._replicas.get(replica_id)
        return replica is not None and replica.last_seq is not None

    def num_blocks(self, replica_id: ReplicaId) -> int:
        replica = self._replicas.get(replica_id)
        return len(replica.blocks) if replica is not None else 0

    def load_snapshot(
        self, replica_id: ReplicaId, block_hashes: Iterable[BlockHash], seq: int
    ) -> None:
        """The replica's cached blocks as of event `seq`; events resume at seq + 1."""
        replica = self._replicas.setdefault(replica_id, _Replica())
        replica.blocks = set(block_hashes)
        replica.last_seq = seq
        replica.approximate.clear()

    def apply_event(
        self, replica_id: ReplicaId, seq: int, kind: str, block_hash: BlockHash | None
    ) -> bool:
        """Apply one event ("stored", "removed", "cleared"). False when the replica is stale or
        `seq` is not the next one: the caller must load a fresh snapshot."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.last_seq is None:
            return False
        if seq <= replica.last_seq:
            return True  # already in the snapshot
        if seq != replica.last_seq + 1:
            self.mark_stale(replica_id)
            return False
        if kind == "cleared":
            replica.blocks.clear()
        elif block_hash is None:
            raise ValueError(f"a {kind!r} event needs a block hash")
        elif kind == "stored":
            replica.blocks.add(block_hash)
        elif kind == "removed":
            replica.blocks.discard(block_hash)
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
        replica.last_seq = seq
        return True

    def mark_stale(self, replica_id: ReplicaId) -> None:
        """The event stream broke: answer from recent routing until the next snapshot."""
        replica = self._replicas.setdefault(replica_id, _Replica())
        if replica.last_seq is not None:
            # Seed the approximation with what was exact a moment ago.
            for block_hash in replica.blocks:
                replica.approximate[block_hash] = None
            self._trim(replica)
        replica.last_seq = None

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._replicas.pop(replica_id, None)

    def record_route(self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash]) -> None:
        """A request with these blocks went to the replica (feeds the approximation)."""
        replica = self._replicas.setdefault(replica_id, _Replica())
        for block_hash in block_hashes:
            replica.approximate[block_hash] = None
            replica.approximate.move_to_end(block_hash)
        self._trim(replica)

    def match(self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the prompt the replica holds."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return 0
        held: set[BlockHash] | OrderedDict[BlockHash, None] = (
            replica.blocks if replica.last_seq is not None else replica.approximate
        )
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def _trim(self, replica: _Replica) -> None:
        while len(replica.approximate) > self.approximate_capacity:
            replica.approximate.popitem(last=False)
