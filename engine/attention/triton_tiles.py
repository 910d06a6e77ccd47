"""What the paged attention kernels share (`triton_decode`'s decode kernel and `triton_prompt`'s
varlen kernel): K/V tiles found through the block table (an FP8 cache's upcast in registers),
the scores (soft-capped where the model caps them), the online softmax in log2 units, and the
tile sizes heads of any width take.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# A K or V tile of either kernel holds at most this many values (BLOCK_N x BLOCK_D): the
# measured 128 x 128 tiles at a head of 128. Gemma's heads of 256 take 64-token tiles instead:
# the prompt kernel's 128 x 128 FP8 tiles in two stages, with their upcast copies, asked for
# 256 KB of shared memory at a head of 256, over the H100's 227 KB (bench/RESULTS.md session 31).
KV_TILE_VALUES = 128 * 128


def kv_tile_tokens(block_n: int, block_d: int) -> int:
    """A tile's BLOCK_N for heads padded to `block_d`: `block_n`, halved until the tile holds
    at most KV_TILE_VALUES values."""
    while block_n * block_d > KV_TILE_VALUES and block_n > 16:
        block_n //= 2
    return block_n


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # the same, or token-minor in an FP8 cache (`cache_views`)
    block_table_ptr,  # this sequence's row of the block table
    start_n,  # the tile's first position (a multiple of BLOCK_N when V_TOKEN_MINOR)
    offs_n,  # [BLOCK_N] token positions in the sequence: start_n onwards
    n_mask,
    kv_end,  # positions from here on are masked (a token-minor V: whole blocks from here)
    kv_head,
    offs_d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,  # V's strides when V_TOKEN_MINOR (a head's [dim, slot] one run), else K's serve
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
    dtype: tl.constexpr,  # what an FP8 cache's values are upcast to (`fp8_query`'s dtype)
):
    """K and V [BLOCK_N, BLOCK_D] of one KV head at `offs_n`, found through the block table
    (masked rows read 0); from an FP8 cache, upcast in registers (exactly: e4m3 fits float16)
    without their scales, which the caller applies once (K's to the scores, V's to the
    output)."""
    physical = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = offs_n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_offsets = (
        physical[:, None] * stride_cb
        + slot[:, None] * stride_cs
        + kv_head * stride_ch
        + offs_d[None, :]
    )
    k = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0)
    if V_TOKEN_MINOR:
        # Whole blocks, each one head's [head dim, BLOCK_SIZE] bytes in one run (`cache_views`:
        # the dims' stride is BLOCK_SIZE), loaded as [blocks, run] so that a warp's lanes walk
        # the run: a quarter warp's eight 16-byte vectors are 128 contiguous bytes. Loaded as
        # [tokens, dim], lanes ran along the tokens, each vector in another block, and every
        # 32-byte sector was read twice (ncu: 33% excess L2 sectors, L2 80% busy). The tokens
        # of a sequence's last block past its end read stale, finite bytes: their weights are 0.
        BLOCK_N: tl.constexpr = offs_n.shape[0]
        BLOCK_D: tl.constexpr = offs_d.shape[0]
        blocks = start_n // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        block_ok = blocks * BLOCK_SIZE < kv_end
        v_blocks = tl.load(block_table_ptr + blocks, mask=block_ok, other=0).to(tl.int64)
        run = tl.arange(0, BLOCK_D * BLOCK_SIZE)  # (dim * BLOCK_SIZE + slot)
        v_mask = block_ok[:, None]
        if HEAD_DIM < BLOCK_D:
            v_mask = v_mask & (run < HEAD_DIM * BLOCK_SIZE)[None, :]
        v = tl.load(
            v_cache_ptr + v_blocks[:, None] * stride_vb + kv_head * stride_vh + run[None, :],
            mask=v_mask,
            other=0.0,
        )
        v = tl.reshape(v, (BLOCK_N // BLOCK_SIZE, BLOCK_D, BLOCK_SIZE))
        v = tl.reshape(tl.permute(v, (0, 2, 1)), (BLOCK_N, BLOCK_D))
    else:
        v = tl.load(v_cache_ptr + k_offsets, mask=kv_mask, other=0.0)
    if FP8:
        k = k.to(dtype)
        v = v.to(dtype)
    return k, v


@triton.jit
def soft_cap(s, softcap):
    """softcap * tanh(s / softcap) (Gemma 2's scores), tanh from one exp."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))


@triton.jit
def scores(q, k, scale, softcap, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """q . k^T [BLOCK_M, BLOCK_N]: raw (the softmax scales them by `score_scale`), or
    soft-capped after the scale, in log2 units, where the model caps them."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        s = soft_cap(s * scale, softcap) * LOG2E
    return s


@triton.jit
def score_scale(scale, SOFTCAP: tl.constexpr):
    """What `online_softmax` multiplies `scores`' values by: to log2 units, scaled."""
    return 1.0 if SOFTCAP else scale * LOG2E


@triton.jit
def online_softmax(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile of scores (times qk_scale: log2 units) and its V into the running max, sum
    and P . V. (qk_scale > 0, so the max of the raw scores scales to theirs; the scale and
    the max's subtraction are one fused multiply-add.)"""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # NOTE: rows with nothing allowed yet keep m = -inf; subtract 0 there, not -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def fp8_query(q):
    """The query an FP8 cache's K meets: float16 (e4m3 converts to it exactly, one instruction
    per pair, and its 11-bit mantissa holds the query and the softmax weights closer than
    bfloat16 does), float32 queries as they are."""
    # (one return: Triton refuses a function whose returns differ in type, constexpr or not)
    if q.dtype != tl.float32:
        q = q.to(tl.float16)
    return q


@triton.jit
def tile_positions(start_n, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """Positions start_n + [0, BLOCK_N); ALIGNED: start_n is known a multiple of BLOCK_N."""
    if ALIGNED:
        start_n = tl.multiple_of(start_n, BLOCK_N)
    return start_n + tl.arange(0, BLOCK_N)
