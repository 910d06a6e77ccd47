"""What both attention kernels take to multiply an FP8 cache's e4m3 values as they lie, without
upcasting them (`triton_decode_e4m3`, and the prompt kernel's E4M3_OPERANDS): a tile's keys
[tokens, dim] and token-minor values [dim, tokens] (each contiguous along the inner dimension
of its product, as an 8-bit operand must be), rows quantized to e4m3 by their own largest
magnitude (the queries), and the online softmax with its weights as e4m3. E4M3 False keeps
every operand in float32 (the Triton interpreter has no e4m3 products): the same program
otherwise, for the CPU tests.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e4m3's largest finite value: a row's largest magnitude and the softmax weight 1 become this
E4M3_MAX = tl.constexpr(448.0)


def takes_e4m3(fp8: bool, token_minor: bool, head_dim: int, softcap: float | None) -> bool:
    """Whether an attention launch can multiply its cache's values as they lie: an FP8 cache's
    head-major blocks, heads whose width is a power of two from 32 (e4m3 products take 32
    inputs a step), no soft-capping (the scores' cap is the upcasting kernels')."""
    width_ok = head_dim >= 32 and head_dim & (head_dim - 1) == 0
    return fp8 and token_minor and width_ok and softcap is None


@triton.jit
def e4m3_rows(x, E4M3: tl.constexpr):
    """(x [rows, cols] float32 as e4m3, each row divided by its scale; the scales [rows], each
    row's largest magnitude / E4M3_MAX); x as it is, scales 1, when not E4M3."""
    scale = tl.full([x.shape[0]], 1.0, dtype=tl.float32)
    if E4M3:
        scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / E4M3_MAX
        x = (x / scale[:, None]).to(tl.float8e4nv)
    return x, scale


@triton.jit
def e4m3_kv_operands(k_cache_ptr, v_cache_ptr, block_table_ptr, start_n, kv_end, kv_head,
                     offs_d, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     E4M3: tl.constexpr):  # fmt: skip
    """A tile's keys K [BLOCK_N, BLOCK_D] and values V^T [BLOCK_D, BLOCK_N] of one KV head, whole
    blocks from start_n (a multiple of BLOCK_N; blocks from kv_end on read 0), as they lie in
    the cache (float32 when not E4M3). Tokens past a sequence's end inside its last block read
    stale, finite bytes: the caller masks their scores."""
    # K: a block's head is [BLOCK_SIZE, HEAD_DIM] in one run (stride_cs = HEAD_DIM)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    token_ok = offs_n // BLOCK_SIZE * BLOCK_SIZE < kv_end
    token_block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=token_ok, other=0)
    k = tl.load(
        k_cache_ptr + token_block.to(tl.int64)[:, None] * stride_cb
        + (offs_n % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :],
        mask=token_ok[:, None],
        other=0.0,
    )  # fmt: skip
    blocks = start_n // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
    block_ok = blocks * BLOCK_SIZE < kv_end
    physical = tl.load(block_table_ptr + blocks, mask=block_ok, other=0).to(tl.int64)
    # V: a block's head is [HEAD_DIM, BLOCK_SIZE] in one run, loaded as [blocks, run]
    run = tl.arange(0, BLOCK_D * BLOCK_SIZE)  # (dim * BLOCK_SIZE + slot)
    v = tl.load(
        v_cache_ptr + physical[:, None] * stride_vb + kv_head * stride_vh + run[None, :],
        mask=block_ok[:, None],
        other=0.0,
    )
    v = tl.reshape(v, (BLOCK_N // BLOCK_SIZE, BLOCK_D, BLOCK_SIZE))
    v_t = tl.reshape(tl.permute(v, (1, 0, 2)), (BLOCK_D, BLOCK_N))
    if not E4M3:
        k = k.to(tl.float32)
        v_t = v_t.to(tl.float32)
    return k, v_t


@triton.jit
def online_softmax_e4m3(s, v_t, m_i, l_i, acc, qk_scale, E4M3: tl.constexpr):
    """`triton_tiles.online_softmax` with the tile's values as V^T [BLOCK_D, BLOCK_N]
    (`e4m3_kv_operands`) and, when E4M3, the weights times E4M3_MAX as e4m3 (`acc` then holds
    P . V times E4M3_MAX), their sum taken before they are rounded, as FlashAttention-3 takes
    it."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # NOTE: rows with nothing allowed yet keep m = -inf; subtract 0 there, not -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    # NOTE: not the rounded weights' sum (the decode kernel's): with the e4m3 weights both
    # summed and the products' A operand, Triton 3.6 gives sums of 0 (bench/RESULTS.md
    # "2026-11-30 (session 39)", bench/next/e4m3_prompt_debug.py).
    if E4M3:
        p = (p * E4M3_MAX).to(tl.float8e4nv)
    acc = acc * alpha[:, None] + tl.dot(p, tl.trans(v_t))
    return m_new, l_i, acc
