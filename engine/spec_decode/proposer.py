"""The proposer interface: draft tokens for a step's decoding requests, all at once.

The engine asks once per step, for the running requests that are decoding, with the number of
drafts the step can afford (`adaptive.DraftLength`); a proposer may return fewer for a request,
or none. Proposing for the whole batch in one call lets a model-based proposer (a draft model,
later an EAGLE-style head) run one batched forward per draft position.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

from kvfleet.engine.core.request import Request, RequestId


class Proposer(abc.ABC):
    # Requests of the last proposal left without drafts only for now (a draft model still
    # catching up on them): not counted as requests that find no drafts.
    num_deferred = 0
    # Whether proposing costs so little (no forward) that the engine may ask beside steps
    # without drafts, and check the drafts against the tokens those steps produce: acceptance
    # stays measured while drafts are off, so they come back when the traffic turns.
    can_shadow = False

    @abc.abstractmethod
    def propose(self, requests: Sequence[Request], num_drafts: int) -> dict[RequestId, list[int]]:
        """Up to `num_drafts` draft tokens to follow each request's tokens (`all_token_ids`);
        requests without any are left out."""

    @abc.abstractmethod
    def forget(self, request_ids: Iterable[RequestId]) -> None:
        """Drop the state of requests that finished (unknown ids are ignored)."""
