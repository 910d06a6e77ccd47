"""KVCacheManager: each request's block table, prefix-cache hits, and slot allocation; and the
host blocks that hold preempted requests' KV (swapped out, copied back when they resume)."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.engine.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.core.scheduler_output import Swaps
from kvfleet.engine.protocol.kv import ROOT_HASH, hash_full_blocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        enable_events: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        """`num_host_blocks`: blocks of host memory for swapped-out requests (0: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events)
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks = list(range(num_host_blocks))
        self.req_to_host: dict[RequestId, list[int]] = {}  # a swapped-out request's host blocks
        # The copies the next step makes before its forward: (device block, host block) out,
        # (host block, device block) in (`take_swaps`).
        self.swaps_out: list[tuple[int, int]] = []
        self.swaps_in: list[tuple[int, int]] = []
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[RequestId, int] = {}
        # Prefix-cache statistics in tokens, vLLM semantics (first start of a request only:
        # `record_prefix_query`).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, request_id: RequestId) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The leading blocks of `request` found (and verified) in the prefix cache, and the
        number of tokens they hold. Never the whole request: the last token's logits are needed."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent = ROOT_HASH
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(block_hash)
            start = i * self.block_size
            tokens = tuple(request.all_token_ids[start : start + self.block_size])
            if block is None or (block.parent_hash, block.token_ids, block.extra_keys) != (
                parent,
                tokens,
                request.extra_keys,
            ):
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request's first start: its tokens asked of the prefix cache, and those found (once
        per request, however many steps it waited before it started)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_held: int | None = None,
    ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens of `request` (after the `num_held` tokens
        its blocks hold, by default its computed ones, and the prefix hits
        `new_computed_blocks`); None, changing nothing, when too few are free."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        held = request.num_computed_tokens if num_held is None else num_held
        num_computed = held + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Touching a free cached block takes it out of the free queue.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        if not req_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:  # (only blocks of known tokens: not a pending one)
            known = min(num_computed + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, req_blocks, known)
        return new_blocks

    def reset(self) -> None:
        """Drop every block table, cached block and swapped-out request: after a failed step,
        when no request holds blocks any more and what the step cached may never have been
        written."""
        self.block_pool.clear()
        self.req_to_blocks.clear()
        self.num_cached_blocks.clear()
        self.req_to_host.clear()
        self.free_host_blocks = list(range(self.num_host_blocks))
        self.take_swaps()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head
        (and its host blocks, if it was swapped out)."""
        self.drop_swapped(request)
        self._free_device_blocks(request)

    def swap_out(self, request: Request) -> bool:
        """Move a preempted request's blocks to host blocks (copied before the next step's
        forward) and free them; False, changing nothing, when the host blocks are too few."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if not blocks or len(blocks) > len(self.free_host_blocks):
            return False
        host = [self.free_host_blocks.pop() for _ in blocks]
        self.req_to_host[request.request_id] = host
        self.swaps_out += [(b.block_id, h) for b, h in zip(blocks, host, strict=True)]
        self._free_device_blocks(request)
        return True

    def is_swapped_out(self, request: Request) -> bool:
        return request.request_id in self.req_to_host

    def drop_swapped(self, request: Request) -> None:
        """Free a swapped-out request's host blocks, unread (finished, or its prefix hits hold
        what they held)."""
        self.free_host_blocks += self.req_to_host.pop(request.request_id, [])

    def allocate_swapped(
        self, request: Request, num_new_tokens: int, hits: Sequence[KVCacheBlock]
    ) -> list[KVCacheBlock] | None:
        """`allocate_slots` for a swapped-out request that resumes with its computed tokens
        (`request.num_computed_tokens`) in host blocks: device blocks for them and the new
        tokens, the prefix hits first (not copied back); queues the copies of the rest."""
        computed = request.num_computed_tokens
        to_copy = computed - len(hits) * self.block_size  # (it holds no device blocks now)
        blocks = self.allocate_slots(request, to_copy + num_new_tokens, hits, num_held=0)
        if blocks is None:
            return None
        host = self.req_to_host.pop(request.request_id)
        device = self.req_to_blocks[request.request_id]
        self.swaps_in += [
            (host[i], device[i].block_id) for i in range(len(hits), self.blocks_needed(computed))
        ]
        self.free_host_blocks += host
        return blocks

    def take_swaps(self) -> Swaps:
        """The copies queued since the last call (out, in), for the next step to make."""
        swaps = self.swaps_out, self.swaps_in
        self.swaps_out, self.swaps_in = [], []
        return swaps

    def _free_device_blocks(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free(reversed(blocks))

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        num_full = num_tokens // self.block_size
        first = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        self._update_block_hashes(request)
        hashes = request.block_hashes
        for i in range(first, num_full):
            start = i * self.block_size
            self.block_pool.cache_block(
                req_blocks[i],
                hashes[i],
                hashes[i - 1] if i > 0 else ROOT_HASH,
                tuple(request.all_token_ids[start : start + self.block_size]),
                request.extra_keys,
            )
        self.num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_full_blocks(
                request.all_token_ids, self.block_size, request.extra_keys, request.block_hashes
            )
