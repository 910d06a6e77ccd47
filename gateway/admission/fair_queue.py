"""FairQueue: the gateway's bounded wait line, by priority, fair between keys, with deadlines.

Lower `priority` values go first (as the engine's). Within a priority, keys take turns by
start-time fair queuing: each key has a virtual finish time that grows by 1/weight per
request served, and the waiting key with the smallest goes next, so two keys with 10:1 demand
are served 1:1 while both wait (or by their weights). A key that was idle starts at the
current virtual time, so it cannot bank credit. Entries past their deadline are dropped and
reported as expired.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvfleet.gateway.admission.rate_limit import KeyId

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    item: T
    deadline: float


@dataclass
class _KeyQueue(Generic[T]):
    entries: deque[_Entry[T]] = field(default_factory=deque)
    finish: float = 0.0  # virtual finish time of the key's last served request


class QueueFull(Exception):
    """The queue holds `capacity` entries (the gateway answers 429 or 503)."""


class FairQueue(Generic[T]):
    def __init__(self, capacity: int, weights: dict[KeyId, float] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.weights = dict(weights or {})
        self._queues: dict[int, dict[KeyId, _KeyQueue[T]]] = {}  # priority -> key -> queue
        self._virtual_time: dict[int, float] = {}
        # Virtual finish times of keys whose queue emptied: a quick return does not reset them.
        self._finished: dict[tuple[int, KeyId], float] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, key_id: KeyId, item: T, deadline: float, priority: int = 0) -> None:
        if self._size >= self.capacity:
            raise QueueFull(f"the queue is full ({self.capacity} requests waiting)")
        keys = self._queues.setdefault(priority, {})
        queue = keys.get(key_id)
        if queue is None:
            queue = keys[key_id] = _KeyQueue()
            # An idle key starts now: it does not bank credit for the time it was away.
            queue.finish = max(
                self._finished.pop((priority, key_id), 0.0), self._virtual_time.get(priority, 0.0)
            )
        queue.entries.append(_Entry(item, deadline))
        self._size += 1

    def pop(self, now: float) -> tuple[T | None, list[T]]:
        """The next item (None if none waits) and the items that expired before it."""
        expired = self.expire(now)
        for priority in sorted(self._queues):
            keys = self._queues[priority]
            waiting = [(q.finish, key_id) for key_id, q in keys.items() if q.entries]
            if not waiting:
                continue
            _, key_id = min(waiting)
            queue = keys[key_id]
            entry = queue.entries.popleft()
            self._size -= 1
            self._virtual_time[priority] = queue.finish
            queue.finish += 1.0 / self.weights.get(key_id, 1.0)
            if not queue.entries:
                self._finished[priority, key_id] = queue.finish
                del keys[key_id]
                if not keys:
                    del self._queues[priority]
            return entry.item, expired
        return None, expired

    def expire(self, now: float) -> list[T]:
        """Remove and return the items whose deadline has passed."""
        expired: list[T] = []
        for priority in list(self._queues):
            keys = self._queues[priority]
            for key_id in list(keys):
                queue = keys[key_id]
                kept = deque(e for e in queue.entries if e.deadline > now)
                expired += [e.item for e in queue.entries if e.deadline <= now]
                queue.entries = kept
                if not kept:
                    del keys[key_id]
            if not keys:
                del self._queues[priority]
        self._size -= len(expired)
        return expired

    def remove(self, item: T) -> bool:
        """Take out a waiting item (its client went away)."""
        for priority, keys in self._queues.items():
            for key_id, queue in keys.items():
                for entry in queue.entries:
                    if entry.item is item:
                        queue.entries.remove(entry)
                        self._size -= 1
                        if not queue.entries:
                            del keys[key_id]
                            if not keys:
                                del self._queues[priority]
                        return True
        return False
