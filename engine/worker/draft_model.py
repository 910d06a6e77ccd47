"""The draft-model proposer: a smaller model of the same tokenizer drafts k tokens greedily.

The draft runs in its own `ModelRunner` over its own paged KV cache (as many blocks as the
target's, each sized for the draft), all requests batched: per proposal, one forward that
catches each request up on the tokens the target produced since its last proposal (the whole
prompt the first time) and drafts one token, then k - 1 single-token steps (decode steps, so
CUDA graphs where the engine uses them).

Between proposals the draft keeps the KV of every token it fed that the target kept: of the k
drafts it fed k - 1, so after a verification that kept a of them its valid prefix ends at the
last kept one, and the next proposal feeds from there (the target's replacement, or the last
draft and the bonus). Drafts are greedy, so each is a point mass (q = 1) for rejection
sampling, as n-gram drafts are: the target's distribution is kept exactly either way.

A proposal feeds at most `max_tokens_per_step` tokens. Requests fresh from their prefill (one
token generated) are fed their whole prompt: the target has just spent more on it than the
draft will. The others' backlog (the tokens since their last proposal) shares a smaller budget,
`catch_up_budget`: twice the proposal's drafts and what feeds them, at least `min_catch_up` (a
few hundred tokens, a forward still bound by streaming the draft's weights). Proposing every
step, that is more than the backlog; after a long pause (the adaptive count drafts once in a
while to measure acceptance, and the backlog is then every request's whole context) it makes
the proposal cost about one draft step, not a prefill of the whole batch, and feeds the
backlogs a few requests at a time. A request whose backlog does not fit is fed what fits and
drafts a later time (`num_deferred` counts those).
A request whose blocks do not fit in the draft's cache, or whose context would pass the
draft's, gets no drafts (the target is never held back).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfleet.engine.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.spec_decode.proposer import Proposer
from kvfleet.engine.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _Progress:
    """What the draft holds of one request."""

    blocks: list[KVCacheBlock]
    computed: int  # leading tokens whose KV is in the draft's cache
    base: int = 0  # the request's length when the draft last proposed (drafts follow it)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        runner: ModelRunner,
        num_blocks: int,
        max_tokens_per_step: int,
        max_model_len: int,
        min_catch_up: int = 512,
    ) -> None:
        """`runner`: the draft model's, its KV cache of `num_blocks` blocks allocated."""
        self.runner = runner
        self.block_size = runner.block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.max_tokens_per_step = max_tokens_per_step
        self.min_catch_up = min_catch_up
        self.max_model_len = max_model_len
        self._progress: dict[RequestId, _Progress] = {}
        self._finished: set[RequestId] = set()  # for the runner to drop at the next step

    def propose(self, requests: Sequence[Request], num_drafts: int) -> dict[RequestId, list[int]]:
        if num_drafts <= 0:
            return {}
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        scheduled: dict[RequestId, int] = {}
        budget = self.max_tokens_per_step
        backlog_budget = self.catch_up_budget(len(requests), num_drafts)
        drafting = []  # those fed all their tokens: they draft
        self.num_deferred = 0
        for request in requests:
            fresh = request.num_output_tokens <= 1
            room = budget if fresh else min(budget, backlog_budget)
            if room <= 0:
                self.num_deferred += 1
                continue
            fed = self._catch_up(request, num_drafts, room, new, cached, scheduled)
            if fed is None:
                continue
            budget -= fed
            backlog_budget -= 0 if fresh else fed
            if self._progress[request.request_id].computed == request.num_tokens:
                drafting.append(request.request_id)
            else:
                self.num_deferred += 1
        if not scheduled:
            return {}
        output = self.runner.execute_model(
            SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), self._finished)
        )
        self._finished = set()
        drafts = {
            req_id: list(tokens)
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True)
            if tokens
        }
        for _ in range(num_drafts - 1):  # each feeds the last draft and drafts the next
            if not drafting:
                break
            step = [
                CachedRequestData(req_id, [], self._progress[req_id].computed)
                for req_id in drafting
            ]
            output = self.runner.execute_model(
                SchedulerOutput([], step, dict.fromkeys(drafting, 1), len(drafting), set())
            )
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
                self._progress[req_id].computed += 1
                drafts[req_id] += tokens
        return drafts

    def catch_up_budget(self, num_requests: int, num_drafts: int) -> int:
        """The most tokens one proposal feeds the draft of requests that are not fresh from
        their prefill."""
        wanted = max(self.min_catch_up, 2 * num_requests * (num_drafts + 1))
        return min(self.max_tokens_per_step, wanted)

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        for request_id in request_ids:
            progress = self._progress.pop(request_id, None)
            if progress is not None:
                self.pool.free(reversed(progress.blocks))
                self._finished.add(request_id)

    def _catch_up(
        self,
        request: Request,
        num_drafts: int,
        budget: int,
        new: list[NewRequestData],
        cached: list[CachedRequestData],
        scheduled: dict[RequestId, int],
    ) -> int | None:
        """Schedule what the draft has not seen of `request` (within `budget`, > 0): its tokens
        from the end of the draft's valid prefix. Returns the tokens scheduled, or None where
        the request does not fit in the draft's context or its cache (no drafts for it)."""
        req_id = request.request_id
        tokens = request.all_token_ids
        if len(tokens) + num_drafts > self.max_model_len:
            return None
        progress = self._progress.get(req_id)
        state = self.runner.requests.get(req_id)
        valid = 0
        if progress is not None and state is not None:
            # The tokens fed are the request's up to `base`, then drafts: those the target
            # kept are valid too.
            # (never the last token: it is fed again, the first draft sampled after it)
            end = min(progress.computed, len(tokens) - 1)
            valid = min(progress.base, end)
            while valid < end and state.token_ids[valid] == tokens[valid]:
                valid += 1
        blocks = progress.blocks if progress is not None else []
        needed = -(-(len(tokens) + num_drafts - 1) // self.block_size) - len(blocks)
        if needed > self.pool.num_free_blocks:
            return None
        added = self.pool.allocate(max(needed, 0))
        blocks += added
        if progress is None:
            progress = self._progress[req_id] = _Progress(blocks, 0)
        count = min(len(tokens) - valid, budget)
        if state is None or req_id in self._finished:  # (the runner drops the old one first)
            new.append(
                NewRequestData(
                    req_id, list(tokens), len(tokens), _GREEDY, [b.block_id for b in blocks], 0
                )
            )
        else:
            del state.token_ids[valid:]
            state.token_ids += tokens[valid:]
            cached.append(CachedRequestData(req_id, [b.block_id for b in added], valid))
        scheduled[req_id] = count
        progress.computed = valid + count
        progress.base = len(tokens)
        return count
