"""Admission: which waiting requests may start (blocks, LoRA slots), and how much of a step a
prompt may take.

Preemption stays rare: a request whose end is known (it ignores EOS: max_tokens decides)
starts only when the free blocks hold it to that end beside what the running requests of known
end will still take; any request starts only while a watermark of the pool (1%) stays free
beside that. So a benchmark of fixed lengths never recomputes, and a pool near full keeps room
for the running requests' next tokens. An idle engine takes anything the pool can hold.

While requests wait to start (with a seat free), a prompt computes at most
`long_prefill_token_threshold` tokens a step, so a long prefill leaves room for requests
arriving meanwhile; and a running prompt always leaves a token to each running request
scheduled after it (a decode behind a long prefill is never starved).
"""

from __future__ import annotations

from kvfleet.engine.core.block_pool import KVCacheBlock
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request

# The fraction of the pool kept free when requests start (vLLM's default watermark)
WATERMARK = 0.01


class AdmissionPolicy:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        long_prefill_token_threshold: int | None,
        enable_chunked_prefill: bool,
        max_loras: int | None = None,
    ) -> None:
        """`long_prefill_token_threshold`: the prompt cap (None: none). `max_loras`: at most
        this many distinct LoRA adapters among running requests (the device slots); a waiting
        request whose adapter would exceed it waits, others pass."""
        if kv_cache_manager.blocks_needed(max_model_len) > kv_cache_manager.num_usable_blocks:
            raise ValueError(
                f"the KV cache ({kv_cache_manager.num_usable_blocks} blocks of "
                f"{kv_cache_manager.block_size} tokens) cannot hold one sequence of max_model_len "
                f"{max_model_len} tokens: lower max_model_len or give the cache more memory"
            )
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 1:
            raise ValueError(
                "long_prefill_token_threshold must be at least 1 (None: no cap), got "
                f"{long_prefill_token_threshold}"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras

    def adapter_fits(self, request: Request, adapters: set[str]) -> bool:
        """Whether `request`'s LoRA adapter fits beside the running requests' `adapters`."""
        name = request.lora_name
        if name is None or self.max_loras is None or name in adapters:
            return True
        return len(adapters) < self.max_loras

    def prompt_cap(self, others_wait: bool, budget: int = 0, num_after: int = 0) -> int | None:
        """The most prompt tokens a request computes this step (None: what the budget holds):
        the threshold while `others_wait` to start; and a running one leaves a token of the
        `budget` left to each of the `num_after` running requests scheduled after it."""
        if not self.enable_chunked_prefill:
            return None
        cap = self.long_prefill_token_threshold if others_wait else None
        if num_after:
            cap = min(cap or budget, max(1, budget - num_after))
        return cap

    def tokens_to_schedule(
        self,
        request: Request,
        budget: int,
        num_hit_tokens: int = 0,
        num_drafts: int = 0,
        cap: int | None = None,
    ) -> int:
        """The tokens `request` computes this step out of `budget`, after its computed ones
        or its prefix hits (`cap`: on prompt tokens; a decode's one token and its drafts are
        never cut)."""
        if request.num_pending_tokens and request.ends_with_pending(self.max_model_len):
            return 0  # its pending token is its last: nothing more to compute
        num_inputs = request.num_tokens + request.num_pending_tokens + num_drafts
        num_new = num_inputs - max(request.num_computed_tokens, num_hit_tokens)
        if num_new > budget and not self.enable_chunked_prefill:
            return 0
        if cap is not None and num_new - num_drafts > 1:
            num_new = min(num_new, cap)
        return min(num_new, budget)

    def blocks_to_end(self, request: Request) -> int:
        """The blocks a running request of known end will still take (0 for others)."""
        horizon = request.kv_horizon(self.max_model_len)
        if horizon is None:
            return 0
        kv = self.kv_cache_manager
        return max(0, kv.blocks_needed(horizon) - kv.num_blocks_held(request.request_id))

    def can_start(
        self,
        request: Request,
        hits: list[KVCacheBlock],
        num_tokens: int,
        reserved: int,
        idle: bool,
    ) -> bool:
        """Whether `request`, computing up to `num_tokens` (its prefix hits `hits`) this step,
        fits beside the `reserved` blocks (`blocks_to_end` of the running) and the watermark:
        to its end, when that is known. `idle`: nothing runs (no watermark)."""
        kv = self.kv_cache_manager
        horizon = request.kv_horizon(self.max_model_len)
        shared = sum(1 for block in hits if block.ref_cnt > 0)  # (held by others already)
        need = kv.blocks_needed(max(num_tokens, horizon or 0)) - shared
        watermark = 0 if idle else int(kv.num_usable_blocks * WATERMARK)
        return need + reserved + watermark <= kv.block_pool.num_free_blocks
