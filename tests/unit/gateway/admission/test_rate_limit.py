"""RateLimiter: exact reservation and settlement, Retry-After, keys independent."""

from __future__ import annotations

import math

import pytest

from kvfleet.gateway.admission.rate_limit import (
    KeyId,
    KeyLimits,
    RateLimiter,
    Refusal,
    Reservation,
    TokenBucket,
)

ALICE, BOB = KeyId("alice"), KeyId("bob")


def test_bucket_refills_continuously_up_to_capacity() -> None:
    bucket = TokenBucket(60, now=0.0)  # 1 per second
    bucket.take(60, 0.0)
    assert bucket.wait_for(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait_for(10, 5.0) == pytest.approx(5.0)
    assert bucket.wait_for(60, 1000.0) == 0.0  # full again, not beyond
    bucket.take(60, 1000.0)
    assert bucket.level == 0
    assert math.isinf(bucket.wait_for(61, 1000.0))  # larger than the whole budget
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0, now=0.0)


def test_reservation_then_settlement_returns_the_unused_tokens_exactly() -> None:
    limiter = RateLimiter({ALICE: KeyLimits(tokens_per_min=1000)})
    first = limiter.reserve(ALICE, 600, now=0.0)  # prompt 100 + max_tokens 500
    assert first == Reservation(ALICE, 600)
    refused = limiter.reserve(ALICE, 600, now=0.0)
    assert isinstance(refused, Refusal)
    assert refused.reason == "tokens per minute"
    assert refused.retry_after_s == pytest.approx(12.0)  # 200 missing at 1000/min
    limiter.settle(first, used_tokens=150, now=0.0)  # the stream stopped early: 450 back
    assert limiter.reserve(ALICE, 600, now=0.0) == Reservation(ALICE, 600)
    assert isinstance(limiter.reserve(ALICE, 300, now=0.0), Refusal)  # 250 left of 1000
    assert limiter.reserve(ALICE, 300, now=3.0) == Reservation(ALICE, 300)  # +50 refilled


def test_cancelled_stream_settles_what_it_used() -> None:
    limiter = RateLimiter({ALICE: KeyLimits(tokens_per_min=100)})
    reservation = limiter.reserve(ALICE, 100, now=0.0)
    assert isinstance(reservation, Reservation)
    limiter.settle(reservation, used_tokens=0, now=0.0)  # cancelled before any token
    assert limiter.reserve(ALICE, 100, now=0.0) == Reservation(ALICE, 100)


def test_request_rate_and_one_keys_burst_does_not_slow_another() -> None:
    limiter = RateLimiter({}, default=KeyLimits(requests_per_min=3))
    for _ in range(3):
        assert isinstance(limiter.reserve(ALICE, 10, now=0.0), Reservation)
    refused = limiter.reserve(ALICE, 10, now=0.0)
    assert isinstance(refused, Refusal)
    assert refused.reason == "requests per minute"
    assert refused.retry_after_s == pytest.approx(20.0)
    assert isinstance(limiter.reserve(BOB, 10, now=0.0), Reservation)  # bob's own bucket


def test_unlimited_key_and_oversized_request() -> None:
    limiter = RateLimiter({ALICE: KeyLimits(tokens_per_min=50)})
    assert isinstance(limiter.reserve(BOB, 10**9, now=0.0), Reservation)  # no limits for bob
    refused = limiter.reserve(ALICE, 51, now=0.0)
    assert isinstance(refused, Refusal)
    assert math.isinf(refused.retry_after_s)


def test_key_store_authenticates_by_hash_with_limits_weights_priorities() -> None:
    from kvfleet.gateway.admission.keys import ANONYMOUS, KeyStore, hash_key

    store = KeyStore.from_mapping(
        {
            "keys": [
                {"id": "batch", "sha256": hash_key("b"), "tokens_per_min": 10, "priority": 5},
                {"id": "live", "sha256": hash_key("l").upper(), "weight": 3},
            ]
        }
    )
    assert store.authenticate("b") == "batch"
    assert store.authenticate("l") == "live"  # hex case does not matter
    assert store.authenticate("x") is None
    assert store.authenticate(None) is None
    assert store.limits()[KeyId("batch")] == KeyLimits(None, 10)
    assert store.weights() == {"batch": 1.0, "live": 3.0}
    assert (store.priority_of(KeyId("batch")), store.priority_of(KeyId("live"))) == (5, 0)
    assert KeyStore([]).authenticate(None) == ANONYMOUS  # open mode
    with pytest.raises(ValueError, match="bad API key entry"):
        KeyStore.from_mapping({"keys": [{"id": "no-hash"}]})


def test_a_key_without_its_own_limit_gets_the_default() -> None:
    """A key listed in the keys file with only a request limit still has the default token
    limit (it was unlimited)."""
    limiter = RateLimiter(
        {ALICE: KeyLimits(requests_per_min=100)}, default=KeyLimits(tokens_per_min=50)
    )
    assert isinstance(limiter.reserve(ALICE, 50, 0.0), Reservation)
    refused = limiter.reserve(ALICE, 10, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.reason == "tokens per minute"
