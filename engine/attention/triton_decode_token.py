"""What a batch-1 decode split (`triton_decode._decode_partial_kernel`) takes of its first
tile and of this step's token around its wait: the first tile's earlier tokens loaded before it
(PRELOAD), where this step's token lies, its running softmax after that tile, and this step's
q, k and v made from the raw row of a qkv layer that cannot rotate (RAW_NEW, `RawToken`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet.engine.attention.triton_tiles import (
    load_kv_tile,
    online_softmax,
    scores,
    tile_positions,
)
from kvfleet.engine.layers.triton_rope import raw_heads_rotated, rotation_tables


@triton.jit
def earlier_first_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len, start, end, kv_head,
                        offs_d, d_mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """What a split may load before the kernel before it has finished (`_decode_partial_kernel`
    PRELOAD, a K-major bf16/fp16/fp32 cache): its first tile's K and V of the tokens before
    this step's (this step's read 0), and where this step's token's K and V lie."""
    positions = tile_positions(start, BLOCK_N, False)
    earlier = (positions < end) & (positions < seq_len - 1)
    # (V K-major: K's strides serve it, the token-minor ones are not read)
    k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, start, positions, earlier, end,
                        kv_head, offs_d, d_mask, stride_cb, stride_cs, stride_ch, stride_cb,
                        stride_ch, BLOCK_SIZE, HEAD_DIM, False, False,
                        k_cache_ptr.dtype.element_ty)  # fmt: skip
    return k, v, new_token_at(block_table_ptr, seq_len, kv_head, offs_d, stride_cb, stride_cs,
                               stride_ch, BLOCK_SIZE)  # fmt: skip


@triton.jit
def new_token_at(block_table_ptr, seq_len, kv_head, offs_d, stride_cb, stride_cs, stride_ch,
                  BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Where this step's token's K (and a K-major V) of `kv_head` lie in the cache."""
    return (
        tl.load(block_table_ptr + (seq_len - 1) // BLOCK_SIZE).to(tl.int64) * stride_cb
        + ((seq_len - 1) % BLOCK_SIZE) * stride_cs
        + kv_head * stride_ch
        + offs_d
    )


@triton.jit
def raw_token_tables(positions_ptr, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr,
                     dtype: tl.constexpr):  # fmt: skip
    """What `raw_token` takes that the kernel before does not write, loaded before the wait:
    (cos, sin) [1, HEAD_DIM] at this step's position (the step's positions are copied in
    before its first kernel, as its block tables and lengths)."""
    return rotation_tables(tl.load(positions_ptr), cos_ptr, sin_ptr, HEAD_DIM // 2, dtype)


@triton.jit
def raw_token(new_ptr, cos, sin, heads, g_mask, kv_head, num_heads, offs_d,
              HEAD_DIM: tl.constexpr):  # fmt: skip
    """(q [heads, HEAD_DIM], k, v [HEAD_DIM]) of this step's token from the qkv layer's raw
    row (`RawToken`): q's group of heads and kv_head's k rotated as the RoPE kernel rotates
    them (`triton_rope.raw_heads_rotated`, `raw_token_tables`' cos and sin), v as it is."""
    dtype = new_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    q = raw_heads_rotated(new_ptr, heads, g_mask, cos, sin, HALF, dtype)
    k_head = num_heads + kv_head + tl.zeros([1], tl.int32)
    k = raw_heads_rotated(new_ptr, k_head, k_head >= 0, cos, sin, HALF, dtype)
    v = tl.load(new_ptr + (num_heads + tl.num_programs(1) + kv_head) * HEAD_DIM + offs_d)
    return q.to(dtype), tl.reshape(k, (HEAD_DIM,)).to(dtype), v


@triton.jit
def write_new_token(k, v, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len, first, end,
                    kv_head, offs_d, stride_cb, stride_cs, stride_ch,
                    BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """This step's token's k and v [HEAD_DIM] into a K-major cache, by the split holding it
    (keys first..end), before its tiles are loaded: a tile after the first reads the token
    back (the barrier: every thread's store made before any thread's load; the first tile,
    loaded before the wait, takes k and v as given, `first_tile_scores`). (Put in each tile
    where it lies instead, the tiles went through registers to shared memory: 39 -> 70 KB a
    program, sm_90.)"""
    if (first <= seq_len - 1) & (seq_len - 1 < end):
        at = new_token_at(block_table_ptr, seq_len, kv_head, offs_d, stride_cb, stride_cs,
                          stride_ch, BLOCK_SIZE)  # fmt: skip
        tl.store(k_cache_ptr + at, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + at, v.to(v_cache_ptr.dtype.element_ty))
    tl.debug_barrier()


@triton.jit
def new_kv(k_cache_ptr, v_cache_ptr, new_at, d_mask):
    """This step's token's K and V from the cache (written by the kernel before)."""
    k = tl.load(k_cache_ptr + new_at, mask=d_mask, other=0.0)
    return k, tl.load(v_cache_ptr + new_at, mask=d_mask, other=0.0)


@triton.jit
def first_tile_scores(q, k_first, v_first, k_new, v_new, seq_len, start, end, m_i, l_i, acc,
                       scale, softcap, qk_scale, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):  # fmt: skip
    """The running softmax after a split's first tile, its earlier tokens preloaded
    (`earlier_first_tile`), this step's token's (k_new, v_new) where it lies in the tile."""
    if start < end:
        positions = tile_positions(start, BLOCK_N, False)
        is_new = (positions == seq_len - 1)[:, None]
        k = tl.where(is_new, k_new[None, :], k_first)
        v = tl.where(is_new, v_new[None, :], v_first)
        s = scores(q, k, scale, softcap, DOT_PRECISION, SOFTCAP)
        s = tl.where((positions < end)[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return m_i, l_i, acc
