"""Swapping preempted requests out to host blocks and back: the block bookkeeping
(kv_cache_manager.py) and the copies (worker/swap_space.py). The engine-level check, every
output equal with swapping, recomputing or a mix, is in tests/unit/engine/test_engine.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request
from kvfleet.engine.worker import swap_space
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
@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
def test_blocks_copied_out_and_back_in_keep_their_bytes(
    dtype: torch.dtype, chunk_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of consecutive host ids and lone ones, staged whole or in chunks of 1 or 2 blocks;
    layers of different widths (each keeps its own bytes)."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 12, 4, 2, width, generator=gen).to(dtype) for width in (3, 5)]
    before = [c.clone() for c in caches]
    block_bytes = SwapSpace.bytes_per_block(caches)
    monkeypatch.setattr(swap_space, "STAGING_BYTES", chunk_blocks * block_bytes)
    space = SwapSpace(caches, num_blocks=9)
    assert space.chunk_blocks == chunk_blocks
    out = [(1, 0), (3, 4), (7, 5), (2, 6), (9, 8)]  # (device, host): runs 0 | 4-6 | 8
    space.copy(caches, (out, []))
    for cache in caches:
        cache[:, [d for d, _ in out]] = torch.zeros((), dtype=torch.float32).to(dtype)  # (reused)
    back = [(0, 10), (4, 11), (5, 1), (6, 3), (8, 2)]  # (host, device)
    space.copy(caches, ([], back))
    for cache, old in zip(caches, before, strict=True):
        for (device, host), (host_in, device_in) in zip(out, back, strict=True):
            assert host == host_in
            assert torch.equal(
                cache[:, device_in].view(torch.uint8), old[:, device].view(torch.uint8)
            )
