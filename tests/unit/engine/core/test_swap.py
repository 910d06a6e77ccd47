"""Swapping preempted requests out to host blocks and back: the block bookkeeping
(kv_cache_manager.py) and the copies (worker/swap_space.py). The engine-level check, every
output equal with swapping, recomputing or a mix, is in tests/unit/engine/test_engine.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request
from kvfleet.engine.worker.swap_space import SwapSpace


def test_a_swapped_out_request_comes_back_in_fresh_blocks_and_gives_its_host_blocks_back(
    make_request: Callable[..., Request],
) -> None:
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=False, num_host_blocks=3)
    a, b = make_request("a", 10), make_request("b", 14)
    assert kv.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10  # (3 blocks, the last one half full)
    assert kv.allocate_slots(b, 14) is not None
    held = kv.get_block_ids("a")
    free = kv.block_pool.num_free_blocks

    assert kv.swap_out(a)
    assert kv.is_swapped_out(a)
    assert kv.num_blocks_held("a") == 0
    assert kv.block_pool.num_free_blocks == free + 3
    assert not kv.swap_out(b)  # (4 blocks: no room left)
    out, into = kv.take_swaps()
    assert [d for d, _ in out] == held
    assert into == []
    host = [h for _, h in out]

    blocks = kv.allocate_swapped(a, 1, [])  # its 10 tokens back, and one more
    assert blocks is not None
    assert len(blocks) == 3
    assert a.num_computed_tokens == 10
    out, into = kv.take_swaps()
    assert out == []
    assert into == list(zip(host, kv.get_block_ids("a"), strict=True))
    assert not kv.is_swapped_out(a)
    assert sorted(kv.free_host_blocks) == [0, 1, 2]


def test_prefix_hits_come_back_without_a_copy_and_a_reset_drops_the_host_blocks(
    make_request: Callable[..., Request],
) -> None:
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, num_host_blocks=8)
    a = make_request("a", 11)
    assert kv.allocate_slots(a, 11) is not None
    a.num_computed_tokens = 11
    assert kv.swap_out(a)
    kv.take_swaps()
    hits, num_hit_tokens = kv.get_computed_blocks(a)  # (its full blocks, still cached)
    assert num_hit_tokens == 8
    assert kv.allocate_swapped(a, 1, hits) is not None
    _, into = kv.take_swaps()
    assert [d for _, d in into] == kv.get_block_ids("a")[2:3]  # only the half-full block

    b = make_request("b", 6)
    assert kv.allocate_slots(b, 6) is not None
    b.num_computed_tokens = 6
    assert kv.swap_out(b)
    kv.reset()
    assert not kv.is_swapped_out(b)
    assert kv.take_swaps() == ([], [])
    assert sorted(kv.free_host_blocks) == list(range(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_copied_out_and_back_in_keep_their_bytes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 8, 4, 2, 3, generator=gen).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    space = SwapSpace(caches, num_blocks=5)
    space.copy(caches, ([(1, 0), (3, 4)], []))
    for cache in caches:
        cache[:, [1, 3]] = torch.zeros((), dtype=torch.float32).to(dtype)  # (reused)
    space.copy(caches, ([], [(0, 6), (4, 2)]))
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache[:, 6].view(torch.uint8), old[:, 1].view(torch.uint8))
        assert torch.equal(cache[:, 2].view(torch.uint8), old[:, 3].view(torch.uint8))
