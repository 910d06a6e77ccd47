"""BlockPool: the KV-cache blocks, their ref counts, the LRU free queue and the prefix cache.

A block is free when no request holds it (ref_cnt 0). A free block may still hold cached
tokens (it has a hash): it can be reused by a prefix hit until it is evicted, which happens when
it reaches the head of the free queue and a new block is needed. Requests free their blocks in
reverse order, so a request's tail blocks, the least likely to be shared, are evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet.engine.protocol.kv import BlockHash

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache: what it holds, for verified hits.
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple[str, ...] = ()
    # Links of the free queue; None when not in it.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class FreeBlockQueue:
    """A doubly linked list of free blocks: O(1) popleft, append and remove from the middle."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinels, never handed out
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None, "not in the queue"
        assert block.next_free is not None, "not in the queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted next) to tail, for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All KV-cache blocks. Block 0 is the null block: never allocated, pads block tables."""

    def __init__(self, num_blocks: int, enable_caching: bool, enable_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        assert self.null_block.block_id == NULL_BLOCK_ID
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """The fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting cached ones."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference to each block, in the given order (the first freed is evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: tuple[str, ...],
    ) -> None:
        """Record that `block` holds these tokens. The first block cached under a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # another block already holds the same tokens; this one stays private
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.token_ids, block.extra_keys = token_ids, extra_keys
        self.cached_blocks[block_hash] = block
        if self.enable_events:
            self.events.append(BlockStored(block_hash, parent_hash, token_ids, extra_keys))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held by a request."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = block.parent_hash = None
            block.token_ids = block.extra_keys = ()
        self.cached_blocks.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def clear(self) -> None:
        """Every block free and uncached, whoever held it (after a failed step, when no
        request holds blocks any more and what was cached may never have been written). The
        same block objects: a frozen heap keeps no stale pool alive."""
        for block in self.blocks:
            block.ref_cnt = 0
            block.prev_free = block.next_free = None
            block.block_hash = block.parent_hash = None
            block.token_ids = block.extra_keys = ()
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.cached_blocks.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())

    def forget_cached(self, extra_key: str) -> int:
        """Drop every cached block hashed with `extra_key` (an unloaded LoRA adapter's, so a
        new adapter under the same name never hits them); returns how many. NOTE: only for
        keys no running request uses: their blocks are all free."""
        stale = [b for b in self.cached_blocks.values() if extra_key in b.extra_keys]
        for block in stale:
            assert block.ref_cnt == 0, "a running request still holds the block"
            self._evict(block)
        return len(stale)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def cached(self) -> list[BlockStored]:
        """Every block in the prefix cache, as the event that stored it (a snapshot)."""
        return [
            BlockStored(block_hash, b.parent_hash, b.token_ids, b.extra_keys)  # type: ignore[arg-type]
            for block_hash, b in self.cached_blocks.items()
        ]

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.enable_events:
                self.events.append(BlockRemoved(block.block_hash))
        block.block_hash = block.parent_hash = None
        block.token_ids = block.extra_keys = ()
