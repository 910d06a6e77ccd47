"""Request: one sequence's tokens, progress and state as the scheduler tracks it."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvfleet.engine.protocol.kv import BlockHash, extra_keys_for
from kvfleet.engine.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """A sequence being generated. `num_computed_tokens` chases `num_tokens`: prefill, chunked
    prefill and decode are the same mechanism."""

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # Extra keys of the prefix-cache hash: requests that differ here never share blocks.
    lora_name: str | None = None
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens that steps already launched will sample, not known yet (asynchronous scheduling:
    # the next step is scheduled while the one before it runs). They count as inputs.
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when first scheduled.
    num_cached_tokens: int | None = None
    # Its output constraint is still compiling: it waits, others pass it (engine/structured/).
    waits_for_grammar: bool = False
    # Hashes of the request's full blocks, in order; extended as tokens arrive.
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        # NOTE: all_token_ids is kept in step with the prompt and outputs by append_output_token.
        self.all_token_ids: list[int] = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def extra_keys(self) -> tuple[str, ...]:
        return extra_keys_for(self.lora_name, self.cache_salt)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def keep_outputs(self, count: int) -> None:
        """Drop the output tokens after the first `count` (never delivered: a step failed)."""
        if count < self.num_output_tokens:
            del self.output_token_ids[count:]
            self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
            self.block_hashes = []  # (hashed again as needed)

    def kv_horizon(self, max_model_len: int) -> int | None:
        """The tokens whose KV the request will hold at its end, when that is known: it ignores
        EOS and has max_tokens (its last sampled token is never computed); None otherwise.
        (A stop string or stop token may still end it sooner: an upper bound then.)"""
        max_tokens = self.sampling_params.max_tokens
        if not self.sampling_params.ignore_eos or max_tokens is None:
            return None
        return min(self.num_prompt_tokens + max_tokens, max_model_len) - 1

    def ends_with_pending(self, max_model_len: int) -> bool:
        """Whether the request reaches max_tokens or max_model_len with its pending tokens."""
        max_tokens = self.sampling_params.max_tokens
        num_outputs = self.num_output_tokens + self.num_pending_tokens
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            self.num_tokens + self.num_pending_tokens >= max_model_len
        )

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """How the request ends with `token_id` just appended (None: it goes on)."""
        params = self.sampling_params
        if not params.ignore_eos and token_id == self.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def drafts_that_fit(self, drafts: list[int], budget: int, max_model_len: int) -> list[int]:
        """The leading drafts this step can verify: only for a request about to compute its
        last token (decoding, none pending), with room for them and the token after them
        within max_tokens, max_model_len and the budget."""
        if self.num_pending_tokens or self.num_computed_tokens != self.num_tokens - 1:
            return []
        room = min(budget, max_model_len - self.num_tokens) - 1
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - self.num_output_tokens - 1)
        return drafts[: max(room, 0)]


def choices_of(
    request_id: RequestId,
    token_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    eos_token_ids: Sequence[int],
    arrival_time: float,
    priority: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[Request]:
    """The sequences one request generates: `params.n` of them (ids `id#i`, sample i seeded
    with seed + i), each stopping at the model's end-of-sequence ids besides the tokenizer's
    (e.g. Llama 3's <|eot_id|>) too, unless it ignores them."""
    extra_eos_ids = (
        ()
        if params.ignore_eos
        else tuple(t for t in eos_token_ids if t != eos_token_id and t not in params.stop_token_ids)
    )
    stop_token_ids = (*params.stop_token_ids, *extra_eos_ids)
    children = []
    for i in range(params.n):
        child_params = params
        if params.n > 1 or stop_token_ids != params.stop_token_ids:
            child_params = dataclasses.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                stop_token_ids=stop_token_ids,
            )
        child_id = RequestId(request_id if params.n == 1 else f"{request_id}#{i}")
        children.append(
            Request(
                child_id,
                token_ids,
                child_params,
                eos_token_id,
                arrival_time,
                priority=priority,
                lora_name=lora_name,
                cache_salt=cache_salt,
            )
        )
    return children
