"""ConcurrencyGate: at most `capacity` requests proxied at once; the rest wait in a FairQueue.

The asyncio side of admission: a request takes a slot or waits (by priority, fair between
keys) until one frees or its queue timeout passes; a full queue refuses at once. Slots are
handed over in queue order on release, so a burst from one key cannot overtake the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvfleet.gateway.admission.fair_queue import FairQueue, QueueFull
from kvfleet.gateway.admission.rate_limit import KeyId


class QueueTimeout(Exception):
    """The request waited longer than the queue timeout."""


class ConcurrencyGate:
    def __init__(
        self,
        capacity: Callable[[], int],
        queue_capacity: int,
        weights: dict[KeyId, float],
        clock: Callable[[], float],
    ) -> None:
        self.capacity = capacity  # read each time: it follows the number of ready replicas
        self.queue: FairQueue[asyncio.Future[None]] = FairQueue(queue_capacity, weights)
        self.clock = clock
        self.in_flight = 0

    async def acquire(self, key_id: KeyId, priority: int, timeout_s: float) -> None:
        """Take a slot, waiting if needed; QueueFull or QueueTimeout when it cannot."""
        if self.in_flight < self.capacity() and len(self.queue) == 0:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.push(key_id, waiter, self.clock() + timeout_s, priority)  # may raise QueueFull
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            self.queue.remove(waiter)
            if waiter.done():
                return  # handed a slot just as the timeout fired: keep it
            waiter.cancel()
            raise QueueTimeout(f"no capacity within {timeout_s:g} s") from None
        except asyncio.CancelledError:  # the client went away while waiting
            self.queue.remove(waiter)
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot it was handed goes to the next one
            else:
                waiter.cancel()
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        while self.in_flight < self.capacity():
            waiter, _ = self.queue.pop(self.clock())  # expired ones time out on their own
            if waiter is None:
                return
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)


__all__ = ["ConcurrencyGate", "QueueFull", "QueueTimeout"]
