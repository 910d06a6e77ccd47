"""One row decode attention left as unmerged splits (`linear.SplitRows`), merged head by head
as a one-row GEMV reads it (`triton_gemv`'s bf16/fp16 kernel, `triton_packed`'s 4/8-bit one),
with the weights `triton_splits.merged` would give the splits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merged_values(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  EAGER: tl.constexpr = False):  # fmt: skip
    """float32 [BLOCK_K]: the row's inputs k0 + [0, BLOCK_K) (0 past K) from decode
    attention's unmerged splits (`SplitRows`): each split's rows weighted by exp(lse_s - max_s
    lse_s) of its head over the weights' sum (`triton_splits.merged`'s weights). Where BLOCK_K
    is a multiple of HEAD_DIM (k0 too) the weights are made once a head, not once an input;
    else (heads of no power of two: Phi-3's 96, tiles splitting heads) once for each head a
    tile touches and gathered to its inputs, the same bits. One split holding keys gives its
    row as it is (weight 1, the others 0); a split holding none is not read (EAGER: read with
    the others, its stale row not used: no load waits on an lse)."""
    if BLOCK_K % HEAD_DIM == 0:
        return _merged_heads(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS, HEAD_DIM, BLOCK_K,
                             EAGER)  # fmt: skip
    else:
        return _merged_inputs(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS, HEAD_DIM, BLOCK_K,
                              EAGER)  # fmt: skip


@triton.jit
def _merged_heads(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  EAGER: tl.constexpr):  # fmt: skip
    """`merged_values` with whole heads a tile: [heads, HEAD_DIM] at once."""
    HEADS: tl.constexpr = BLOCK_K // HEAD_DIM
    heads = k0 // HEAD_DIM + tl.arange(0, HEADS)
    head_ok = heads * HEAD_DIM < K
    lse_at = lse_ptr + heads * lse_stride
    top = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_at + s, mask=head_ok, other=float("-inf")))
    ks = heads[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    total = tl.zeros([HEADS], tl.float32)
    x = tl.zeros([HEADS, HEAD_DIM], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_at + s, mask=head_ok, other=float("-inf"))
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
        total += weight
        if EAGER:
            part = tl.load(parts_ptr + s * K + ks, mask=head_ok[:, None], other=0.0)
            x += tl.where(weight[:, None] > 0.0, weight[:, None] * part.to(tl.float32), 0.0)
        else:
            part = tl.load(parts_ptr + s * K + ks, mask=(weight > 0.0)[:, None], other=0.0)
            x += weight[:, None] * part.to(tl.float32)
    x = x * (1.0 / tl.where(total == 0.0, 1.0, total))[:, None]
    return tl.reshape(x, [BLOCK_K])


@triton.jit
def _merged_inputs(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                   EAGER: tl.constexpr):  # fmt: skip
    """`merged_values` for tiles that split heads: the weights made once for each head the tile
    touches, then gathered to its inputs (a weight made input by input took Qwen3-30B-A3B's o
    GEMV 4.1 -> 7.9 us: its exps, bench/RESULTS.md session 42)."""
    HEADS: tl.constexpr = triton.next_power_of_2(BLOCK_K // HEAD_DIM + 2)
    first = k0 // HEAD_DIM
    heads = first + tl.arange(0, HEADS)
    head_ok = heads * HEAD_DIM < K
    lse_at = lse_ptr + heads * lse_stride
    top = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_at + s, mask=head_ok, other=float("-inf")))
    total = tl.zeros([HEADS], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_at + s, mask=head_ok, other=float("-inf"))
        total += tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    at = ks // HEAD_DIM - first  # (each input's head among `heads`)
    x = tl.zeros([BLOCK_K], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_at + s, mask=head_ok, other=float("-inf"))
        weight = tl.gather(tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top)), at, 0)
        if EAGER:
            part = tl.load(parts_ptr + s * K + ks, mask=k_ok, other=0.0)
            x += tl.where(weight > 0.0, weight * part.to(tl.float32), 0.0)
        else:
            part = tl.load(parts_ptr + s * K + ks, mask=weight > 0.0, other=0.0)
            x += weight * part.to(tl.float32)
    return x * (1.0 / tl.gather(tl.where(total == 0.0, 1.0, total), at, 0))
