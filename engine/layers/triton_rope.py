"""Rotary embedding (RoPE) in Triton and the KV-cache write of the rotated keys: alone, with the
cache write (and Qwen3's / Gemma 3's per-head q/k norms) in one launch, or as the last step of
a one-row qkv GEMV (`RotaryWrite`, `rotary_write_pairs`: the bf16 and e4m3 GEMVs').

Every product and sum is rounded to the model dtype where the torch chain rounds
(`torch_layers.RotaryEmbedding`), so each path gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import next_power_of_2


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorms of q and k (Qwen3, Gemma 3), for the kernels that apply them."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    offset: bool  # times (1 + weight) (Gemma)


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest even) and back to float32. NOTE: for bfloat16
    with integer ops, since the compiler may fold a cast down and back up into nothing."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """The neox rotation of halves x1, x2 (float32), each product and sum rounded to `dtype`."""
    out1 = rounded(x1 * cos, dtype) - rounded(x2 * sin, dtype)
    out2 = rounded(x2 * cos, dtype) + rounded(x1 * sin, dtype)
    return out1, out2


@triton.jit
def _rotary_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    cos_ptr,  # [max_position, head_dim / 2] float32
    sin_ptr,
    positions_ptr,  # [num_tokens] int64
    stride_t,
    stride_h,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HALF's power of two (Phi-3's heads of 96: 48 lanes of 64)
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    dtype = x_ptr.dtype.element_ty
    # NOTE: every product and the sum are rounded to the model dtype, as the torch chain does,
    # so both paths give the same bits.
    cos = rounded(tl.load(cos_ptr + position * HALF + d, mask=d_ok, other=0.0)[None, :], dtype)
    sin = rounded(tl.load(sin_ptr + position * HALF + d, mask=d_ok, other=0.0)[None, :], dtype)
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & d_ok[None, :]
    base = x_ptr + token * stride_t + heads * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    tl.store(base, out1.to(dtype), mask=mask)
    tl.store(base + HALF, out2.to(dtype), mask=mask)


def rotary_inplace(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Neox-style rotation of x [num_tokens, num_heads, head_dim] at `positions`, in place."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    assert x.stride(2) == 1, "the head dimension must be contiguous"
    _rotary_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        positions,
        x.stride(0),
        x.stride(1),
        num_heads,
        HALF=head_dim // 2,
        HALF_PAD=next_power_of_2(head_dim // 2),
        BLOCK_H=next_power_of_2(num_heads),
    )


@triton.jit
def kv_cache_value(x, kv_scales_ptr, part: tl.constexpr, cache_ptr, FP8: tl.constexpr):
    """`x` as the KV cache stores it: in its dtype, or for an FP8 cache divided by the layer's
    K (part 0) or V (part 1) scale, saturating at e4m3's largest value (as the torch
    backend's write)."""
    if FP8:
        scale = tl.load(kv_scales_ptr + part)
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _normed_halves(
    x1, x2, weight_ptr, d, d_ok, eps, HALF: tl.constexpr, OFFSET: tl.constexpr,
    dtype: tl.constexpr,
):  # fmt: skip
    """RMSNorm over each row of [x1 | x2] (one head's two halves, float32 [heads, lanes d],
    0 past HALF), rounded where `rms_normalize` rounds: the normalized values in `dtype`, then
    times the weight, in `dtype` (OFFSET: times 1 + weight in float32, rounded once); float32
    out. `d_ok`: the lanes below HALF."""
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(squares * (1.0 / (2 * HALF)) + eps)[:, None]
    w1 = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    if OFFSET:
        return rounded(x1 * rstd * (1.0 + w1), dtype), rounded(x2 * rstd * (1.0 + w2), dtype)
    n1 = rounded(w1 * rounded(x1 * rstd, dtype), dtype)
    return n1, rounded(w2 * rounded(x2 * rstd, dtype), dtype)


@triton.jit
def rotation_tables(position, cos_ptr, sin_ptr, HALF: tl.constexpr, dtype: tl.constexpr):
    """(cos, sin) [1, 2 * HALF] at `position` for `raw_heads_rotated`, each half's angles
    repeated over both halves (rounded to `dtype`, as `_rotate` takes them)."""
    d = tl.arange(0, 2 * HALF)[None, :] % HALF
    cos = rounded(tl.load(cos_ptr + position * HALF + d), dtype)
    return cos, rounded(tl.load(sin_ptr + position * HALF + d), dtype)


@triton.jit
def raw_heads_rotated(row_ptr, heads, head_ok, cos, sin, HALF: tl.constexpr,
                      dtype: tl.constexpr):  # fmt: skip
    """float32 [heads, 2 * HALF]: heads `heads` of one token's raw q or k rows at row_ptr (in
    `dtype`, 2 * HALF each; 0 where not head_ok) rotated by `rotation_tables`' cos and sin,
    the bits `rotary_write_pairs` makes (`RawToken`: decode attention makes them from the
    qkv layer's raw row, the tables loaded before its wait). Each value is loaded beside its
    rotation partner (d +- HALF), not as halves joined after: no layout change of the head."""
    d = tl.arange(0, 2 * HALF)[None, :]
    at = row_ptr + heads[:, None] * (2 * HALF)
    x = tl.load(at + d, mask=head_ok[:, None], other=0.0).to(tl.float32)
    p = tl.load(at + (d + HALF) % (2 * HALF), mask=head_ok[:, None], other=0.0).to(tl.float32)
    turned = rounded(p * sin, dtype)  # (`_rotate`: x1 cos - x2 sin | x2 cos + x1 sin)
    return rounded(x * cos, dtype) + tl.where(d < HALF, -turned, turned)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], read only: rotated into the cache
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    cos_ptr,  # [max_position, head_dim / 2] float32
    sin_ptr,
    positions_ptr,  # [num_tokens] int64
    slot_mapping_ptr,  # [num_tokens] int64
    kv_scales_ptr,  # [2] float32 (an FP8 cache's K and V scales)
    q_norm_ptr,  # [head_dim]: q's per-head RMSNorm weight (QK_NORM)
    k_norm_ptr,  # [head_dim]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,  # the V cache's (token-minor in an FP8 cache's head-major blocks)
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_heads,
    num_kv_heads,
    eps,  # the q/k norms' (QK_NORM)
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HALF's power of two (`_rotary_kernel`'s)
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    QK_NORM: tl.constexpr,  # each head of q and k RMS-normalized first (Qwen3, Gemma 3)
    OFFSET: tl.constexpr,  # those norms times (1 + weight) (Gemma)
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    token = tl.program_id(0)
    let_next_start(PDL)
    wait_for_previous(PDL)
    position = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF_PAD)[None, :]
    d_ok = d < HALF
    dtype = q_ptr.dtype.element_ty
    cos = rounded(tl.load(cos_ptr + position * HALF + d, mask=d_ok, other=0.0), dtype)
    sin = rounded(tl.load(sin_ptr + position * HALF + d, mask=d_ok, other=0.0), dtype)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q = q_ptr + token * stride_qt + heads * stride_qh + d
    mask = (heads < num_heads) & d_ok
    x1 = tl.load(q, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(q + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _normed_halves(x1, x2, q_norm_ptr, d, d_ok, eps, HALF, OFFSET, dtype)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    tl.store(q, out1.to(dtype), mask=mask)
    tl.store(q + HALF, out2.to(dtype), mask=mask)
    kv_heads = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = (kv_heads < num_kv_heads) & d_ok
    k = k_ptr + token * stride_kt + kv_heads * stride_kh + d
    x1 = tl.load(k, mask=kv_mask, other=0.0).to(tl.float32)
    x2 = tl.load(k + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _normed_halves(x1, x2, k_norm_ptr, d, d_ok, eps, HALF, OFFSET, dtype)
    slot = tl.load(slot_mapping_ptr + token)
    dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_heads * stride_ch
    dest += d
    k1, k2 = _rotate(x1, x2, cos, sin, dtype)
    k1 = kv_cache_value(k1.to(dtype), kv_scales_ptr, 0, k_cache_ptr, FP8)
    k2 = kv_cache_value(k2.to(dtype), kv_scales_ptr, 0, k_cache_ptr, FP8)
    tl.store(k_cache_ptr + dest, k1, mask=kv_mask)
    tl.store(k_cache_ptr + dest + HALF, k2, mask=kv_mask)
    v = v_ptr + token * stride_vt + kv_heads * stride_vh + d
    v1 = kv_cache_value(tl.load(v, mask=kv_mask), kv_scales_ptr, 1, v_cache_ptr, FP8)
    v2 = kv_cache_value(tl.load(v + HALF, mask=kv_mask), kv_scales_ptr, 1, v_cache_ptr, FP8)
    v_dest = (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vcs
    v_dest += kv_heads * stride_vch + d * stride_vcd
    tl.store(v_cache_ptr + v_dest, v1, mask=kv_mask)
    tl.store(v_cache_ptr + v_dest + HALF * stride_vcd, v2, mask=kv_mask)


@dataclass
class RotaryWrite:
    """What a one-row qkv GEMV needs to rotate its q rows and write its k and v rows into the
    cache itself, as `rotary_and_write_kv` would after it (`triton_gemv.gemv(rotary=...)`)."""

    positions: torch.Tensor  # [1] int64
    cos: torch.Tensor  # [max_position, head_dim / 2] float32
    sin: torch.Tensor
    k_cache: torch.Tensor  # `cache_views`: [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [1] int64
    kv_scales: torch.Tensor | None  # an FP8 cache's K and V scales
    num_heads: int
    num_kv_heads: int
    qk_norm: QKNorm | None = None  # each head of q and k RMS-normalized first

    @property
    def heads(self) -> int:
        """q's and k's heads: the counters a GEMV's programs count themselves in at."""
        return self.num_heads + self.num_kv_heads

    def args(self, counters: torch.Tensor) -> tuple[object, ...]:
        """The kernel's arguments for it (`_gemv_kernel`'s rotary ones); `counters`: at least
        `heads` zeros (with a `qk_norm`)."""
        norm = self.qk_norm
        return (self.cos, self.sin, self.positions, self.slot_mapping, self.k_cache,
                self.v_cache, self.kv_scales if self.kv_scales is not None else self.cos,
                *self.k_cache.stride()[:3], *self.v_cache.stride(), self.num_heads,
                self.num_kv_heads, norm.q_weight if norm else self.cos,
                norm.k_weight if norm else self.cos, counters,
                norm.eps if norm else 0.0)  # fmt: skip


@dataclass(frozen=True)
class RawToken:
    """One token's qkv projection row as a layer that cannot rotate leaves it (4/8-bit
    weights, LoRA), for decode attention to rotate its q and k heads in registers and to write
    its k and v into the cache itself (`triton_decode`'s RAW_NEW), in place of the RoPE
    kernel after the GEMV."""

    qkv: torch.Tensor  # [1, (num_heads + 2 * num_kv_heads) * head_dim], contiguous
    positions: torch.Tensor  # [1] int64
    cos: torch.Tensor  # [max_position, head_dim / 2] float32
    sin: torch.Tensor


def rotary_arguments(
    rotary: RotaryWrite | None, n: int, block_n: int, counters: torch.Tensor
) -> tuple[tuple[object, ...], dict[str, object]]:
    """(the rotary arguments, the rotary constants) of a one-row GEMV kernel of N rows in
    blocks of `block_n` (`_gemv_kernel`'s and its kin's); `counters`: the heads' (placeholders
    without a `rotary`)."""
    if rotary is None:
        placeholders: tuple[object, ...] = (counters,) * 7 + (0,) * 9 + (counters,) * 3 + (0.0,)
        off = dict[str, object](ROTARY=False, HALF=1, CACHE_BLOCK=1, FP8_CACHE=False,
                                QK_NORM=False, QK_OFFSET=False)  # fmt: skip
        return placeholders, off
    half = rotary.cos.shape[1]
    assert n == (rotary.num_heads + 2 * rotary.num_kv_heads) * 2 * half, "q | k | v heads"
    assert half % (block_n // 2) == 0, "a program's pairs in one head"
    norm = rotary.qk_norm
    assert norm is None or half == next_power_of_2(half), "a head's norm in one tile"
    constants = dict[str, object](ROTARY=True, HALF=half, CACHE_BLOCK=rotary.k_cache.shape[1],
                                  FP8_CACHE=rotary.k_cache.dtype == torch.float8_e4m3fn,
                                  QK_NORM=norm is not None,
                                  QK_OFFSET=norm is not None and norm.offset)  # fmt: skip
    return rotary.args(counters), constants


@triton.jit
def pair_rows(pid_n, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The BLOCK_N rows of a qkv projection program `pid_n` takes when it rotates them
    (`rotary_write_pairs`): BLOCK_N / 2 pairs (d, d + HALF) of one head, interleaved."""
    i = tl.arange(0, BLOCK_N)
    pair = pid_n * (BLOCK_N // 2) + i // 2
    return (pair // HALF) * (2 * HALF) + pair % HALF + (i % 2) * HALF


@triton.jit
def rotary_write_pairs(
    out, pid_n, out_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, k_cache_ptr,
    v_cache_ptr, kv_scales_ptr, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs,
    stride_vch, stride_vcd, num_heads, num_kv_heads, q_norm_ptr, k_norm_ptr, count_ptr, qk_eps,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    QK_NORM: tl.constexpr, QK_OFFSET: tl.constexpr,
):  # fmt: skip
    """One token's qkv rows `out` (float32, `pair_rows`' order) as `rotary_and_write_kv`
    leaves them after the GEMV wrote them: q rows rotated into out, k rows rotated into the
    K cache, v rows into the V cache, each at the token's slot (the same bits: rounded to
    out's dtype first). QK_NORM: each head of q and k RMS-normalized first (`QKNorm`): its
    programs write their rows into out and count themselves in at `count_ptr` [heads]; the
    last of a head's to arrive normalizes, rotates and writes the whole head."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    dtype = out_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(rounded(out, dtype), (PAIRS, 2)))
    first = pid_n * PAIRS
    head = first // HALF
    d = first % HALF + tl.arange(0, PAIRS)
    slot = tl.load(slot_mapping_ptr)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    if head < num_heads + num_kv_heads:
        position = tl.load(positions_ptr)
        if QK_NORM:
            tl.store(out_ptr + head * 2 * HALF + d, x1.to(dtype))
            tl.store(out_ptr + head * 2 * HALF + HALF + d, x2.to(dtype))
            tl.debug_barrier()  # (every thread's rows written before the count says so)
            arrived = tl.atomic_add(count_ptr + head, 1, sem="acq_rel")
            if arrived == HALF // PAIRS - 1:
                whole = tl.arange(0, HALF)[None, :]
                row = out_ptr + head * 2 * HALF + whole
                h1 = tl.load(row, cache_modifier=".cg").to(tl.float32)
                h2 = tl.load(row + HALF, cache_modifier=".cg").to(tl.float32)
                weight_ptr = tl.where(head < num_heads, q_norm_ptr, k_norm_ptr)
                h1, h2 = _normed_halves(h1, h2, weight_ptr, whole, whole < HALF, qk_eps, HALF,
                                        QK_OFFSET, dtype)  # fmt: skip
                _rotate_into(h1, h2, head, whole, position, cos_ptr, sin_ptr, out_ptr,
                             k_cache_ptr, kv_scales_ptr, block * stride_cb + offset * stride_cs,
                             stride_ch, num_heads, HALF, FP8)  # fmt: skip
                tl.atomic_xchg(count_ptr + head, 0)
        else:
            _rotate_into(x1, x2, head, d, position, cos_ptr, sin_ptr, out_ptr, k_cache_ptr,
                         kv_scales_ptr, block * stride_cb + offset * stride_cs, stride_ch,
                         num_heads, HALF, FP8)  # fmt: skip
    else:
        v_head = head - num_heads - num_kv_heads
        dest = block * stride_vcb + offset * stride_vcs + v_head * stride_vch + d * stride_vcd
        v1 = kv_cache_value(x1.to(dtype), kv_scales_ptr, 1, v_cache_ptr, FP8)
        v2 = kv_cache_value(x2.to(dtype), kv_scales_ptr, 1, v_cache_ptr, FP8)
        tl.store(v_cache_ptr + dest, v1)
        tl.store(v_cache_ptr + dest + HALF * stride_vcd, v2)


@triton.jit
def _rotate_into(
    x1, x2, head, d, position, cos_ptr, sin_ptr, out_ptr, k_cache_ptr, kv_scales_ptr, slot_at,
    stride_ch, num_heads, HALF: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Halves x1, x2 (float32, at `d` of `head`) rotated: a q head's into out, a k head's into
    the K cache at `slot_at`."""
    dtype = out_ptr.dtype.element_ty
    cos = rounded(tl.load(cos_ptr + position * HALF + d), dtype)
    sin = rounded(tl.load(sin_ptr + position * HALF + d), dtype)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    if head < num_heads:
        tl.store(out_ptr + head * 2 * HALF + d, out1.to(dtype))
        tl.store(out_ptr + head * 2 * HALF + HALF + d, out2.to(dtype))
    else:
        dest = slot_at + (head - num_heads) * stride_ch + d
        k1 = kv_cache_value(out1.to(dtype), kv_scales_ptr, 0, k_cache_ptr, FP8)
        k2 = kv_cache_value(out2.to(dtype), kv_scales_ptr, 0, k_cache_ptr, FP8)
        tl.store(k_cache_ptr + dest, k1)
        tl.store(k_cache_ptr + dest + HALF, k2)


def rotary_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    qk_norm: QKNorm | None = None,
) -> None:
    """Rotate q in place and k, v into the cache, in one launch: the bits `rotary_inplace`
    then the attention's cache write give (k itself is left as it was). The caches: views
    [num_blocks, block_size, num_kv_heads, head_dim], K's head dimension contiguous (the
    attention's `cache_views`). An FP8 cache takes k and v divided by `kv_scales`. `qk_norm`:
    each head of q and k RMS-normalized first, as `rms_norm_heads` would (the normalized q is
    what is rotated in place)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "the head dimension must be contiguous"
    assert k_cache.stride(3) == 1
    pdl = dependent_launch_args(q.device)
    _rotary_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        slot_mapping,
        kv_scales if kv_scales is not None else cos,
        qk_norm.q_weight if qk_norm is not None else cos,
        qk_norm.k_weight if qk_norm is not None else cos,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        num_heads,
        num_kv_heads,
        qk_norm.eps if qk_norm is not None else 0.0,
        HALF=head_dim // 2,
        HALF_PAD=next_power_of_2(head_dim // 2),
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KV=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        QK_NORM=qk_norm is not None,
        OFFSET=qk_norm is not None and qk_norm.offset,
        **pdl,
    )
