"""Speculator: what the engine holds for speculative decoding, set up from the config.

Each step the engine asks it how many drafts the batch affords (`num_drafts`), then for the
drafts of the running requests that are decoding (`propose`); the scheduler verifies them as
tokens to compute, and the engine reports each finished step back (`observe`: kept drafts;
`observe_cost`: its size and the time it took). A step without drafts calls `shadow`: with a
proposer cheap enough (n-gram), a few requests get drafts that are never verified, only
compared with the tokens the requests produce next, so the acceptance and the share of
requests with drafts stay measured while drafts are off (and drafts resume when they would
pay); other proposers are asked with one draft per request now and then instead (explorations).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from kvfleet.engine.config import SpeculativeConfig
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.spec_decode.adaptive import DraftLength, StepCosts
from kvfleet.engine.spec_decode.ngram import NgramProposer
from kvfleet.engine.spec_decode.proposer import Proposer


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        model: torch.nn.Module,
        device: torch.device,
        proposer: Proposer | None = None,
    ) -> None:
        """`model`: the target (its size gives the step-cost prior); `proposer`: the draft
        model's for the `draft` method (the `ngram` one is built here)."""
        self.config = config
        self.proposer = proposer or _ngram(config)
        self.draft_length = DraftLength(
            config.num_speculative_tokens,
            config.adaptive,
            _cost_prior(model, device),
            explores=not self.proposer.can_shadow,
        )
        # Steps drafts were asked for (with or without any coming back), and the time spent
        # proposing them (a draft model's forwards included): what speculation costs besides
        # the verified tokens.
        self.num_proposals = 0
        self.propose_seconds = 0.0
        # Drafts proposed beside steps without drafts, not verified: request id -> (the
        # request, the position of the token the draft guesses, the draft); and where the
        # next turn starts.
        self._shadowed: dict[RequestId, tuple[Request, int, int]] = {}
        self._shadow_turn = 0

    SHADOWED_PER_STEP = 2

    def num_drafts(self, batch_size: int) -> int:
        """Drafts per decoding request for the next step of about `batch_size` requests."""
        return self.draft_length.choose(batch_size)

    def propose(self, running: Sequence[Request], num_drafts: int) -> dict[RequestId, list[int]]:
        """Drafts for the running requests that are decoding and take them (not those that
        opted out, nor those with penalties or logprobs)."""
        decoding = [
            r
            for r in running
            if r.num_computed_tokens == r.num_tokens - 1
            and not r.num_pending_tokens
            and r.sampling_params.may_speculate
        ]
        if not decoding:
            return {}
        began = time.perf_counter()
        drafts = self.proposer.propose(decoding, num_drafts)
        self.num_proposals += 1
        self.propose_seconds += time.perf_counter() - began
        asked = len(decoding) - self.proposer.num_deferred
        self.draft_length.observe_proposals(asked, len(drafts))
        return drafts

    def shadow(self, running: Sequence[Request]) -> None:
        """A step without drafts (adaptive, a proposer that `can_shadow`): score the earlier
        shadow drafts whose token is known now (a sampled token equals a draft with the
        probability that verification would keep it), then draft for the next few decoding
        requests in turn, unverified."""
        if not (self.config.adaptive and self.proposer.can_shadow):
            return
        scored = matched = 0
        for req_id, (request, position, draft) in list(self._shadowed.items()):
            if request.num_tokens > position:  # (those that end are forgotten)
                del self._shadowed[req_id]
                scored += 1
                matched += request.all_token_ids[position] == draft
        asked = []
        for i in range(min(self.SHADOWED_PER_STEP, len(running))):
            request = running[(self._shadow_turn + i) % len(running)]
            if (
                request.request_id not in self._shadowed
                and request.num_output_tokens
                and request.sampling_params.may_speculate
            ):
                asked.append(request)
        self._shadow_turn += self.SHADOWED_PER_STEP
        drafts = self.proposer.propose(asked, 1) if asked else {}
        for request in asked:
            if request.request_id in drafts:
                self._shadowed[request.request_id] = (
                    request,
                    request.num_tokens,
                    drafts[request.request_id][0],
                )
        self.draft_length.observe_proposals(len(asked), len(drafts))
        self.draft_length.observe(matched, scored - matched)

    def observe(self, num_accepted: int, num_rejected: int) -> None:
        """A finished step's kept drafts and its rejections."""
        self.draft_length.observe(num_accepted, num_rejected)

    def observe_cost(self, num_tokens: int, seconds: float, drafted: bool) -> None:
        """A step of `num_tokens` took `seconds` of the engine's time (`drafted`: with drafts
        asked for)."""
        self.draft_length.observe_cost(num_tokens, seconds, drafted)

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._shadowed.pop(request_id, None)
        self.proposer.forget(request_ids)


def _ngram(config: SpeculativeConfig) -> Proposer:
    if config.method != "ngram":
        raise ValueError(f"the {config.method!r} speculative method needs its proposer")
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _cost_prior(model: torch.nn.Module, device: torch.device) -> StepCosts:
    """Step costs before any step is timed: the weights streamed at an assumed bandwidth (at
    least a millisecond of launches), and the work per token at an assumed arithmetic rate."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = (3e12, 4e14) if device.type == "cuda" else (2e10, 2e11)
    return StepCosts(fixed=max(1e-3, weight_bytes / bandwidth), per_token=2 * params / flops)
