"""The plain data exchanged each step: SchedulerOutput -> runner -> ModelRunnerOutput -> outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.engine.core.request import RequestId
from kvfleet.engine.sampling_params import SamplingParams

# A step's KV copies: preempted requests' blocks out to host memory (device block, host block),
# resumed ones' back in (host block, device block).
Swaps = tuple[list[tuple[int, int]], list[tuple[int, int]]]


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    req_id: RequestId
    token_ids: list[int]  # the prompt, plus the outputs so far when resumed
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_name: str | None = None


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: what changed since the last step."""

    req_id: RequestId
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute this step per request, in batch order.
    num_scheduled_tokens: dict[RequestId, int]
    total_num_scheduled_tokens: int
    # Requests finished or preempted since the last step: the runner drops their state.
    finished_req_ids: set[RequestId]
    preempted_req_ids: set[RequestId] = field(default_factory=set)
    # Draft tokens to verify, per decoding request that carries some: its scheduled tokens are
    # its last token, then these (speculative decoding).
    scheduled_spec_decode_tokens: dict[RequestId, list[int]] = field(default_factory=dict)
    swaps: Swaps = field(default_factory=lambda: ([], []))  # (made before the forward)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position: the sampled token's, then the top ones."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class ModelRunnerOutput:
    req_ids: list[RequestId]
    # Per request, the tokens sampled this step; empty after a prefill chunk that samples none.
    sampled_token_ids: list[list[int]]
    # Per request, one entry per sampled token, or None when the request asked for no logprobs.
    logprobs: list[list[TokenLogprobs] | None]


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one request produced in one step, after the stop checks on token ids."""

    req_id: RequestId
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
