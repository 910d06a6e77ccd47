"""The n-gram proposer (prompt lookup): draft tokens copied from the request's own context.

When a request's last n tokens appeared before in its prompt or output, the tokens that followed
that earlier occurrence are a good guess for what comes next (a model rewriting, quoting or
summarizing a document repeats whole spans of it). The longest n in [min_n, max_n] that matches
wins, and among its occurrences the latest.

Each request keeps an index from n-gram to the position after its latest occurrence, extended
by the n-grams each new token completes, so a proposal costs one dictionary lookup per n
whatever the context length. An n-gram enters the index only once a token follows it, so the
request's own suffix never matches itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.spec_decode.proposer import Proposer


class NgramIndex:
    """One request's n-grams (min_n..max_n tokens) -> where the token after their latest
    occurrence sits."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # tokens whose following n-grams are in the index

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the n-grams that end before the last token of `token_ids` (all of them but
        the suffix the next proposal looks up)."""
        for end in range(max(self._indexed, 1), len(token_ids)):
            # n-grams ending at token end - 1, followed by token `end`
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._after[tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(token_ids))

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest
        matching suffix of `token_ids` (already `extend`ed with it); [] without a match."""
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(token_ids[len(token_ids) - n :]))
            if start is not None:
                return list(token_ids[start : start + k])
        return []


class NgramProposer(Proposer):
    """Draft tokens for each request by prompt lookup over its prompt and output so far."""

    can_shadow = True

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[Request], num_drafts: int) -> dict[RequestId, list[int]]:
        drafts = {}
        for request in requests:
            found = self.draft(request.request_id, request.all_token_ids, num_drafts)
            if found:
                drafts[request.request_id] = found
        return drafts

    def draft(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (the request's prompt and outputs)."""
        if k <= 0:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        return index.lookup(token_ids, k)

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)
