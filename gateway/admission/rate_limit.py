"""Per-key token buckets on requests/min and tokens/min, with reservation and settlement.

A request reserves one request and `prompt + max_tokens` tokens when admitted; when it ends,
`settle` returns what it did not use (a cancelled stream uses only what was sent). A key that
cannot be served now gets the seconds until it could (Retry-After). Keys never share a bucket,
so one key's burst never slows another.

Several gateway pods hold one limit together: each counts what it charged (`usage`), and
charges its own buckets with what its peers charged (`charge_peer`, from `gateway.peers`), so
every pod's bucket is its view of the key's one bucket across the whole gateway. Between two
exchanges (`synced`) a pod takes at most 1/N of the level it last saw (N pods): pods admitting
at once never spend the same budget twice, and a pod that gets all of a key's traffic still
gets the whole rate (what it leaves is there at the next exchange).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
        # Several pods: what this one may take before its peers next hear of it
        self.allowance: float | None = None
        self.taken_since_sync = 0.0

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

    def within_allowance(self, amount: float, pods: int, now: float) -> bool:
        """Whether this pod may take `amount` before the next exchange with its peers. The
        first take since an exchange always may (the bucket itself has room for it)."""
        if pods <= 1:
            return True
        if self.allowance is None:
            self.sync(pods, now)
        assert self.allowance is not None
        return self.taken_since_sync == 0 or self.taken_since_sync + amount <= self.allowance

    def take_local(self, amount: float, now: float) -> None:
        self.take(amount, now)
        self.taken_since_sync += amount

    def sync(self, pods: int, now: float) -> None:
        """The peers' charges are in: a new allowance, 1/pods of the level seen now."""
        self._refill(now)
        self.allowance = max(0.0, self.level) / max(1, pods)
        self.taken_since_sync = 0.0

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


@dataclass
class Usage:
    """What one gateway pod charged a key since it started (net of tokens given back)."""

    requests: float = 0.0
    tokens: float = 0.0


class RateLimiter:
    def __init__(
        self,
        limits: dict[KeyId, KeyLimits],
        default: KeyLimits | None = None,
        peers: Callable[[], int] = lambda: 1,
        sync_interval_s: float = 1.0,
    ) -> None:
        self.limits = dict(limits)
        self.default = default or KeyLimits()
        self.peers = peers  # gateway pods sharing the limits, this one included
        self.sync_interval_s = sync_interval_s
        self._requests: dict[KeyId, TokenBucket] = {}
        self._tokens: dict[KeyId, TokenBucket] = {}
        self._usage: dict[KeyId, Usage] = {}

    def usage(self) -> dict[KeyId, Usage]:
        """This pod's charges per key (monotonic in requests; tokens net of give-backs)."""
        return {k: Usage(u.requests, u.tokens) for k, u in self._usage.items()}

    def synced(self, now: float) -> None:
        """An exchange with the peers finished: every bucket gets its next allowance."""
        pods = self.peers()
        for bucket in [*self._requests.values(), *self._tokens.values()]:
            bucket.sync(pods, now)

    def charge_peer(self, key_id: KeyId, requests: float, tokens: float, now: float) -> None:
        """Another pod charged (or, negative, gave back) this much of the key's budget."""
        request_bucket, token_bucket = self._buckets(key_id, now)
        for bucket, amount in ((request_bucket, requests), (token_bucket, tokens)):
            if bucket is None or amount == 0:
                continue
            if amount > 0:
                bucket.take(amount, now)  # may go below zero: debt, repaid by the refill
            else:
                bucket.give_back(-amount, now)

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
        pods = self.peers()
        for bucket, amount, what in ((requests, 1, "requests"), (token_bucket, tokens, "tokens")):
            if bucket is not None and not bucket.within_allowance(amount, pods, now):
                # this pod's part until its peers next hear of it: wait for the exchange
                return Refusal(self.sync_interval_s, f"{what} per minute")
        if requests is not None:
            requests.take_local(1, now)
        if token_bucket is not None:
            token_bucket.take_local(tokens, now)
        usage = self._usage.setdefault(key_id, Usage())
        usage.requests += 1
        usage.tokens += tokens
        return Reservation(key_id, tokens)

    def settle(self, reservation: Reservation, used_tokens: int, now: float) -> None:
        """The request ended having used `used_tokens` (prompt + generated): return the rest.
        Using more than reserved (it cannot, max_tokens bounds it) is charged as debt."""
        _, token_bucket = self._buckets(reservation.key_id, now)
        if token_bucket is None:
            return
        unused = reservation.tokens - used_tokens
        self._usage.setdefault(reservation.key_id, Usage()).tokens -= unused
        if unused >= 0:
            token_bucket.give_back(unused, now)
        else:
            token_bucket.take(-unused, now)

    def _buckets(self, key_id: KeyId, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        own = self.limits.get(key_id, self.default)
        # A key's own limit where it sets one, else the default (`--tokens-per-min` is the
        # limit of every key that names none, listed in the keys file or not).
        limits = KeyLimits(
            own.requests_per_min
            if own.requests_per_min is not None
            else self.default.requests_per_min,
            own.tokens_per_min if own.tokens_per_min is not None else self.default.tokens_per_min,
        )
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
