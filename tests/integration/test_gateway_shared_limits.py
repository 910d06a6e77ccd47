"""Per-key limits held by two gateway pods together: what a key gets through both stays within
10% of what one gateway admits, whichever pod its requests reach (real gateways on loopback,
exchanging usage as peers, in front of a fake engine)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kvfleet.bench.fake_engine import fake_engine
from kvfleet.bench.gateway_limits import hammer
from kvfleet.engine.parallel.worker import free_port
from kvfleet.gateway.admission.keys import KeyStore, hash_key
from kvfleet.gateway.admission.rate_limit import KeyLimits
from kvfleet.gateway.app import GatewaySettings, create_gateway_app

from .test_gateway_admission import serve

TOKENS_PER_MIN = 2700.0  # 45 a second: the 8 s window needs ~43 requests/s at most
REQUEST_TOKENS = 9  # 8 prompt token ids + max_tokens 1; the fake engine reports 9 used
WINDOW_S = 8.0


@contextlib.contextmanager
def gateways(engine_url: str, count: int) -> Iterator[list[str]]:
    """`count` gateways over one engine, each given every gateway's URL as its peers (its own
    among them: it recognizes and skips itself)."""
    keys = KeyStore.from_mapping({"keys": [{"id": "team", "sha256": hash_key("secret")}]})
    ports = [free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    with contextlib.ExitStack() as stack:
        for port in ports:
            settings = GatewaySettings(
                replicas=(engine_url,),
                keys=keys,
                default_limits=KeyLimits(tokens_per_min=TOKENS_PER_MIN),
                peers=tuple(urls) if count > 1 else (),
                peer_sync_interval_s=0.2,
            )
            stack.enter_context(serve(create_gateway_app(settings), port=port))
        time.sleep(0.5)  # the peers have read each other once
        yield urls


def admitted(urls: list[str]) -> int:
    """Tokens the key got through in WINDOW_S of requests as fast as answers come."""
    return sum(tokens for _, tokens in hammer(urls, WINDOW_S, 3, key="secret"))


def test_two_gateways_admit_what_one_gateway_admits() -> None:
    with serve(fake_engine()) as engine_url:
        with gateways(engine_url, 1) as (one,):
            alone = admitted([one])
        with gateways(engine_url, 2) as pair:
            spread = admitted(pair)  # every client connection on both pods
        with gateways(engine_url, 2) as pair:
            sticky = admitted(pair[:1])  # one pod gets all of the key's traffic
    # one gateway: a full bucket, then the refill
    bound = TOKENS_PER_MIN + TOKENS_PER_MIN / 60 * WINDOW_S
    assert 0.9 * bound <= alone <= 1.1 * bound, (alone, bound)
    # two pods sharing the key's budget: the same, not twice (nor half)
    assert 0.9 * alone <= spread <= 1.1 * alone, (spread, alone)
    # all on one pod: it takes half of what is left each exchange, so it gets it all soon
    assert 0.9 * alone <= sticky <= 1.1 * alone, (sticky, alone)
