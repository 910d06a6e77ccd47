"""KVCacheManager: slot allocation, verified prefix hits, freeing order, statistics."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and 2 tokens


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocate_caches_full_blocks_only(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", PROMPT)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert ids(kv.allocate_slots(a, 10) or []) == [1, 2, 3]
    assert kv.num_cached_blocks["a"] == 2
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is kv.req_to_blocks["a"][0]
    assert len(kv.block_pool.cached_blocks) == 2
    # Decode 2 more tokens: the third block fills and is cached; a fourth is allocated after.
    a.num_computed_tokens = 10
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens = 11
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) == []
    assert kv.num_cached_blocks["a"] == 3
    a.num_computed_tokens = 12
    a.append_output_token(7)
    assert ids(kv.allocate_slots(a, 1) or []) == [4]
    assert kv.get_block_ids(a.request_id) == [1, 2, 3, 4]


def test_shared_prefix_is_reused_and_verified(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)

    b = make_request("b", [*PROMPT[:8], 1, 2, 3, 4, 5])
    hits, num_tokens = kv.get_computed_blocks(b)
    assert (ids(hits), num_tokens) == ([1, 2], 8)
    assert ids(kv.allocate_slots(b, 13 - 8, hits) or []) == [4, 5]
    assert kv.get_block_ids(b.request_id) == [1, 2, 4, 5]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)  # (counted at a start)
    kv.record_prefix_query(b.num_tokens, num_tokens)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (13, 8)

    # The last token is always recomputed: an identical 8-token prompt hits one block only.
    c = make_request("c", PROMPT[:8])
    assert kv.get_computed_blocks(c)[1] == 4

    # A cached block whose stored tokens disagree (a hash collision) is not a hit.
    kv.req_to_blocks["a"][1].token_ids = (0, 0, 0, 0)
    d = make_request("d", PROMPT)
    assert kv.get_computed_blocks(d)[1] == 4


def test_extra_keys_separate_caches(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    kv.allocate_slots(make_request("a", PROMPT), 10)
    lora = make_request("b", PROMPT)
    lora.lora_name = "adapter-1"
    salted = make_request("c", PROMPT)
    salted.cache_salt = "tenant-1"
    assert kv.get_computed_blocks(lora) == ([], 0)
    assert kv.get_computed_blocks(salted) == ([], 0)


def test_failed_allocation_changes_nothing(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)  # blocks 1-3; block 4 free
    kv.free(a)  # all free again, blocks 1 and 2 cached
    b = make_request("b", [*PROMPT[:8], *range(20)])  # needs 7 blocks, 2 of them hits
    hits, _ = kv.get_computed_blocks(b)
    free_before = kv.block_pool.free_queue.block_ids()
    assert kv.allocate_slots(b, 20, hits) is None
    assert kv.block_pool.free_queue.block_ids() == free_before
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert "b" not in kv.req_to_blocks


def test_free_releases_tail_first(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)
    kv.free(a)
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert "a" not in kv.req_to_blocks
    assert kv.usage == 0.0


def test_caching_off(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    kv.allocate_slots(make_request("a", PROMPT), 10)
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", PROMPT)) == ([], 0)
