"""What the engine returns per request: text, token ids, finish reason, logprobs, timings."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engine.core.scheduler_output import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic clock readings (seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
