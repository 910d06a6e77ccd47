"""Readings of the scheduler's state, made on the engine thread with each step and handed to
other threads as immutable records (no other thread reads the scheduler or the block pool)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.engine.core.kv_cache_manager import KVCacheManager
    from kvfleet.engine.core.request import Request


@dataclass
class SpecDecodeStats:
    """Speculative decoding so far (vLLM's counters): requests' steps that carried drafts,
    the drafts, and those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # drafted steps that had a draft rejected

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted step emits on average (1 + accepted per drafted step; 0: none)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler after a step: for metrics, admission and the autoscaler's signals."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up in the prefix cache so far
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    num_preemptions_swapped: int  # of which swapped out to host memory (the rest recomputed)
    # adapters of running and of waiting requests (empty without LoRA)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    spec_decode: SpecDecodeStats | None = None  # a copy; None: speculative decoding is off


def read_stats(
    kv: KVCacheManager,
    running: Sequence[Request],
    waiting: Sequence[Request],
    preemptions: tuple[int, int],
    spec_decode: SpecDecodeStats | None,
    with_adapters: bool,
) -> SchedulerStats:
    """A scheduler's reading from its parts (`preemptions`: all, and of them swapped out;
    `spec_decode` copied; adapters' names sorted)."""

    def adapters(requests: Sequence[Request]) -> tuple[str, ...]:
        if not with_adapters:
            return ()
        return tuple(sorted({r.lora_name for r in requests if r.lora_name}))

    return SchedulerStats(
        num_running=len(running),
        num_waiting=len(waiting),
        kv_cache_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=preemptions[0],
        num_preemptions_swapped=preemptions[1],
        running_adapters=adapters(running),
        waiting_adapters=adapters(waiting),
        spec_decode=dataclasses.replace(spec_decode) if spec_decode is not None else None,
    )
