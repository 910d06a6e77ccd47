"""Per-key token buckets on requests/min and tokens/min, with reservation and settlement.

A request reserves one request and `prompt + max_tokens` tokens when admitted; when it ends,
`settle` returns what it did not use (a cancelled stream uses only what was sent). A key that
cannot be served now gets the seconds until it could (Retry-After). Keys never share a bucket,
so one key's burst never slows another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NewType

KeyId = NewType("KeyId", str)


@dataclass(frozen=True)
class KeyLimits:
    requests_per_min: float | None = None  # None: unlimited
    tokens_per_min: float | None = None


class TokenBucket:
    """Holds up to `capacity`, refilled continuously at `capacity` per minute."""

    def __init__(self, per_minute: float, now: float) -> None:
        if per_minute <= 0:
            raise ValueError(f"a rate limit must be positive, got {per_minute}")
        self.capacity = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = per_minute
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0: now; inf: never, it exceeds the capacity)."""
        self._refill(now)
        if amount > self.capacity:
            return math.inf
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.level = min(self.capacity, self.level + elapsed * self.rate_per_s)
        self.updated = now


@dataclass(frozen=True)
class Reservation:
    key_id: KeyId
    tokens: int


@dataclass(frozen=True)
class Refusal:
    retry_after_s: float  # inf: the request is larger than the key's whole budget
    reason: str


class RateLimiter:
    def __init__(self, limits: dict[KeyId, KeyLimits], default: KeyLimits | None = None) -> None:
        self.limits = dict(limits)
        self.default = default or KeyLimits()
        self._requests: dict[KeyId, TokenBucket] = {}
        self._tokens: dict[KeyId, TokenBucket] = {}

    def reserve(self, key_id: KeyId, tokens: int, now: float) -> Reservation | Refusal:
        """Take one request and `tokens` from the key's buckets, or say how long to wait."""
        requests, token_bucket = self._buckets(key_id, now)
        waits = []
        if requests is not None:
            waits.append((requests.wait_for(1, now), "requests per minute"))
        if token_bucket is not None:
            waits.append((token_bucket.wait_for(tokens, now), "tokens per minute"))
        wait, reason = max(waits, default=(0.0, ""))
        if wait > 0:
            return Refusal(wait, reason)
        if requests is not None:
            requests.take(1, now)
        if token_bucket is not None:
            token_bucket.take(tokens, now)
        return Reservation(key_id, tokens)

    def settle(self, reservation: Reservation, used_tokens: int, now: float) -> None:
        """The request ended having used `used_tokens` (prompt + generated): return the rest.
        Using more than reserved (it cannot, max_tokens bounds it) is charged as debt."""
        _, token_bucket = self._buckets(reservation.key_id, now)
        if token_bucket is None:
            return
        unused = reservation.tokens - used_tokens
        if unused >= 0:
            token_bucket.give_back(unused, now)
        else:
            token_bucket.take(-unused, now)

    def _buckets(self, key_id: KeyId, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        limits = self.limits.get(key_id, self.default)
        requests = tokens = None
        if limits.requests_per_min is not None:
            if key_id not in self._requests:
                self._requests[key_id] = TokenBucket(limits.requests_per_min, now)
            requests = self._requests[key_id]
        if limits.tokens_per_min is not None:
            if key_id not in self._tokens:
                self._tokens[key_id] = TokenBucket(limits.tokens_per_min, now)
            tokens = self._tokens[key_id]
        return requests, tokens
