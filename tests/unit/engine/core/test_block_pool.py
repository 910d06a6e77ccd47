"""BlockPool: the null block, ref counts, the LRU free queue, the prefix cache and its events."""

from __future__ import annotations

import pytest

from kvfleet.engine.core.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVCacheBlock,
)
from kvfleet.engine.protocol.kv import ROOT_HASH, BlockHash, hash_block_tokens


def h(n: int) -> BlockHash:
    return hash_block_tokens(ROOT_HASH, [n])


def test_free_queue_is_o1_linked_list() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    for _ in range(4):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 3
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 are free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_ref_counts_and_usage() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.usage == 0.5
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0)
    assert pool.free_queue.block_ids() == [3, 4, 2]
    pool.free([a])
    assert pool.free_queue.block_ids() == [3, 4, 2, 1]
    assert pool.usage == 0.0


def test_cached_free_blocks_are_evicted_in_lru_order() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True, enable_events=True)
    blocks = pool.allocate(4)
    for n, block in enumerate(blocks):
        pool.cache_block(block, h(n), ROOT_HASH, (n,), ())
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])  # freed order = eviction order
    assert pool.free_queue.block_ids() == [3, 1, 4, 2]

    # A hit on a free cached block pulls it out of the queue.
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.touch([blocks[0]])
    assert pool.free_queue.block_ids() == [3, 4, 2]

    (fresh,) = pool.allocate(1)
    assert fresh is blocks[2]  # block 3, cached hash h(2), evicted first
    assert fresh.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(3)) is blocks[3]
    assert pool.take_events() == [
        BlockStored(h(0), ROOT_HASH, (0,), ()),
        BlockStored(h(1), ROOT_HASH, (1,), ()),
        BlockStored(h(2), ROOT_HASH, (2,), ()),
        BlockStored(h(3), ROOT_HASH, (3,), ()),
        BlockRemoved(h(2)),
    ]
    assert pool.take_events() == []


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), ROOT_HASH, (1,), ())
    pool.cache_block(b, h(1), ROOT_HASH, (1,), ())
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(1), ROOT_HASH, (1,), ())
    assert pool.get_cached_block(h(1)) is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True, enable_events=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(1), ROOT_HASH, (1,), ())
    assert not pool.reset_prefix_cache()  # a is held
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is None
    assert pool.take_events()[-1] == AllBlocksCleared()


def test_forget_cached_drops_one_adapters_blocks_only() -> None:
    pool = BlockPool(6, enable_caching=True, enable_events=True)
    blocks = pool.allocate(3)
    keys = [("lora:a",), ("lora:b",), ("lora:a", "salt:x")]
    for i, (block, extra) in enumerate(zip(blocks, keys, strict=True)):
        pool.cache_block(block, h(i), ROOT_HASH, (i,), extra)
    pool.free(blocks)
    pool.take_events()
    assert pool.forget_cached("lora:a") == 2
    assert pool.get_cached_block(h(0)) is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[1]
    assert pool.take_events() == [BlockRemoved(h(0)), BlockRemoved(h(2))]
    assert pool.num_free_blocks == 5  # the blocks stay free, only uncached
