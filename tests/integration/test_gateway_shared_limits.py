"""Per-key limits held by two real gateways on loopback, peered with `--peer`-style settings:
a key's budget spent on one is refused on the other once they have exchanged usage. (The
figures per minute: `tests/unit/gateway/test_peers.py` on a simulated clock, and
`python -m kvfleet.bench.gateway_limits` on real processes, bench/RESULTS.md.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx

from kvfleet.bench.fake_engine import MODEL, fake_engine
from kvfleet.engine.worker.process import free_port
from kvfleet.gateway.admission.keys import KeyStore, hash_key
from kvfleet.gateway.admission.rate_limit import KeyLimits
from kvfleet.gateway.app import GatewaySettings, create_gateway_app

from .test_gateway_admission import serve

REQUEST_TOKENS = 9  # 8 prompt token ids + max_tokens 1
TOKENS_PER_MIN = 10 * REQUEST_TOKENS  # ten requests a minute


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
                peers=tuple(urls),
                peer_sync_interval_s=0.2,
            )
            stack.enter_context(serve(create_gateway_app(settings), port=port))
        yield urls


def post(url: str) -> int:
    body = {"model": MODEL, "prompt": list(range(8)), "max_tokens": 1}
    headers = {"authorization": "Bearer secret"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10).status_code


def spend(url: str) -> int:
    """Requests of the key this gateway admits until its first refusal."""
    admitted = 0
    while post(url) == 200:
        admitted += 1
        assert admitted <= 40, "no limit at all"
    return admitted


def test_two_gateways_admit_one_budget_not_two() -> None:
    """Each gateway alone would admit the key's ten requests; together they admit ten."""
    with serve(fake_engine()) as engine_url, gateways(engine_url, 2) as (first, second):
        time.sleep(1.0)  # five exchange intervals: each has read the other
        on_first = spend(first)
        time.sleep(0.5)  # the second hears of it at its next exchange
        on_second = spend(second)
    assert on_first >= 5  # its part of the budget at once
    # the key's budget once (a refill of 1.5 tokens a second adds nothing in these seconds)
    assert on_first + on_second <= TOKENS_PER_MIN // REQUEST_TOKENS
