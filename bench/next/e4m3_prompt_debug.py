"""On the GPU: where the prompt kernel's E4M3_OPERANDS path turns NaN (call 68: every output NaN,
the decode kernel's e4m3 path fine). Each product of `triton_e4m3`'s pieces alone, in the prompt
kernel's orientation (queries the products' rows) and the decode kernel's (swapped), against
torch over the same e4m3 values:
    bench/device_env.sh python3 bench/next/e4m3_prompt_debug.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kvfleet.engine.attention.triton_e4m3 import (
    E4M3_MAX,
    e4m3_kv_operands,
    e4m3_rows,
    online_softmax_e4m3,
)

FP8 = torch.float8_e4m3fn


@triton.jit
def _products(q, q_scale, k, v_t, p, E4M3: tl.constexpr, SWAPPED: tl.constexpr):
    """(1) the scores Q K^T, row-scaled; (2) P V of given weights in [0, 1]; SWAPPED: each as
    the decode kernel takes it, the queries and weights the products' narrow side."""
    if E4M3:
        p = (p * E4M3_MAX).to(tl.float8e4nv)
    if SWAPPED:
        s = tl.trans(tl.dot(k, tl.trans(q)))
        pv = tl.trans(tl.dot(v_t, tl.trans(p)))
    else:
        s = tl.dot(q, tl.trans(k))
        pv = tl.dot(p, tl.trans(v_t))
    if E4M3:
        pv = pv / E4M3_MAX
    return s * q_scale[:, None], pv


@triton.jit
def _rounded_sum_step(s, v_t, m_i, l_i, acc, qk_scale, E4M3: tl.constexpr):
    """Call 68's online_softmax_e4m3: the rounded weights both summed and the A operand."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    if E4M3:
        p = (p * E4M3_MAX).to(tl.float8e4nv)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1) / E4M3_MAX
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p, tl.trans(v_t))


@triton.jit
def _first_step(s, v_t, qk_scale, E4M3: tl.constexpr, SWAPPED: tl.constexpr):
    """A first softmax step without the running state: the weights' sum before rounding, or
    SWAPPED after it with the weights the products' shared-memory side."""
    m_i = tl.max(s, 1) * qk_scale
    p = tl.exp2(s * qk_scale - m_i[:, None])
    l_i = tl.sum(p, 1)
    if E4M3:
        p = (p * E4M3_MAX).to(tl.float8e4nv)
        if SWAPPED:
            l_i = tl.sum(p.to(tl.float32), 1) / E4M3_MAX
    acc = tl.trans(tl.dot(v_t, tl.trans(p))) if SWAPPED else tl.dot(p, tl.trans(v_t))
    return m_i, l_i, acc


@triton.jit
def _probe(q_ptr, p_ptr, k_cache_ptr, v_cache_ptr, table_ptr, s_ptr, pv_ptr, o_ptr, kv_end,
           stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           E4M3: tl.constexpr, SWAPPED: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * BLOCK_D + offs_d[None, :])
    q, q_scale = e4m3_rows(q, E4M3)
    k, v_t = e4m3_kv_operands(k_cache_ptr, v_cache_ptr, table_ptr, 0, kv_end, 0, offs_d,
                              stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_SIZE,
                              BLOCK_N, BLOCK_D, E4M3)  # fmt: skip
    p = tl.load(p_ptr + rows[:, None] * BLOCK_N + cols[None, :])
    s, pv = _products(q, q_scale, k, v_t, p, E4M3, SWAPPED)
    tl.store(s_ptr + rows[:, None] * BLOCK_N + cols[None, :], s)
    tl.store(pv_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], pv)
    # (3) one online-softmax step over the scores: MODE 0 as the prompt kernel takes it
    # (`online_softmax_e4m3`), 1 with the weights' sum taken before they are rounded, 2 the
    # product swapped (the weights the products' smem side, as the decode kernel has them), 3
    # call 68's online_softmax_e4m3 (the rounded weights both summed and the A operand: NaN)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    s = tl.dot(q, tl.trans(k)) * q_scale[:, None]
    qk_scale = 0.088 * 1.4426950408889634
    if MODE == 0:
        m_i, l_i, acc = online_softmax_e4m3(s, v_t, m_i, l_i, acc, qk_scale, E4M3)
    elif MODE == 3:
        m_i, l_i, acc = _rounded_sum_step(s, v_t, m_i, l_i, acc, qk_scale, E4M3)
    else:
        m_i, l_i, acc = _first_step(s, v_t, qk_scale, E4M3, MODE == 2)
    if E4M3:
        acc = acc / E4M3_MAX
    tl.store(o_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None])


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: the interpreter, float32 only)
    for block_m, block_n in ((64, 64), (128, 128)):
        _shape(dev, block_m, block_n)


def _fp8(*shape: int, dev: str) -> torch.Tensor:
    return (torch.randn(*shape, device=dev) * 100).clamp(-448, 448).to(FP8)


def _error(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"nan {int(got.isnan().sum())} rel {float((got - want).norm() / want.norm()):.2e}"


def _shape(dev: str, block_m: int, block_n: int) -> None:
    block_d, block_size, heads, blocks = 128, 16, 2, 16
    k_cache = _fp8(blocks, heads, block_size, block_d, dev=dev)
    v_cache = _fp8(blocks, heads, block_d, block_size, dev=dev)
    table = torch.randperm(blocks, device=dev)[: block_n // block_size].int()
    q = torch.randn(block_m, block_d, device=dev)
    p = torch.rand(block_m, block_n, device=dev)
    # the reference over the same values: K [tokens, dim], V [tokens, dim] of head 0
    k = k_cache[table.long(), 0].float().reshape(block_n, block_d)
    v = v_cache[table.long(), 0].float().transpose(1, 2).reshape(block_n, block_d)
    want = {"s": q @ k.T, "pv": p @ v, "o": torch.softmax(q @ k.T * 0.088, 1) @ v}
    got = {name: torch.empty_like(value) for name, value in want.items()}
    runs = itertools.product(
        (False, True) if dev == "cuda" else (False,), (False, True), range(4), (4, 8)
    )
    for e4m3, swapped, mode, warps in runs:
        _probe[(1,)](q, p, k_cache, v_cache, table, got["s"], got["pv"], got["o"], block_n,
                     k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), v_cache.stride(0),
                     v_cache.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                     BLOCK_SIZE=block_size, E4M3=e4m3, SWAPPED=swapped, MODE=mode,
                     num_warps=warps, num_stages=1)  # fmt: skip
        errors = "; ".join(f"{name} {_error(got[name], want[name])}" for name in want)
        print(f"{block_m}x{block_n} e4m3 {e4m3} swapped {swapped} warps {warps} mode {mode}: "
              f"{errors}")  # fmt: skip


if __name__ == "__main__":
    main()
