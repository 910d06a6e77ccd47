"""Fused Triton kernels for the Llama layers: residual add + RMSNorm (per row or per head),
SiLU·mul (rotary embedding: `triton_rope`).

Each replaces a chain of small torch kernels (about 9 for the norm, 3 for SiLU·mul) with one
launch, rounding where the torch reference in `torch_layers.py` rounds: the residual add in the
model dtype, statistics in float32, the normalized value cast back before the weight is
applied, SiLU's output in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import cdiv, next_power_of_2
from kvfleet.engine.layers.quantization.fp8 import _MIN_SCALE, FP8, FP8_MAX, QuantizedRows
from kvfleet.engine.layers.quantization.triton_fp8 import quantized_row
from kvfleet.engine.layers.triton_rope import rounded

# Warps of the norm kernels: the fused all-reduce + norm (engine/parallel/triton_peer.py) uses
# the same, so both reduce a row's squares in the same order (the same bits).
NORM_WARPS = 8


@triton.jit
def rms_normalize(x, weight, hidden, eps, OFFSET: tl.constexpr):
    """weight * RMSNorm(x) for one row x [BLOCK] (zero beyond `hidden`), in x's dtype: float32
    statistics, the normalized value rounded before the weight is applied; with OFFSET (Gemma)
    (1 + weight) * RMSNorm(x) in float32, rounded once."""
    return rms_scaled(x, weight, inverse_rms(x, hidden, eps), OFFSET)


@triton.jit
def inverse_rms(x, hidden, eps):
    """1 / RMS(x) (+ eps under the root) of one row x [BLOCK] (zero beyond `hidden`), float32."""
    x32 = x.to(tl.float32)
    # times 1/n as torch's mean does (a division rounds differently in the last bit)
    variance = tl.sum(x32 * x32, axis=0) * (1.0 / hidden)
    return tl.rsqrt(variance + eps)


@triton.jit
def rms_scaled(x, weight, inv_rms, OFFSET: tl.constexpr):
    """`rms_normalize`'s values for inputs x of a row whose `inverse_rms` is `inv_rms` (any
    part of the row: the values are made one by one)."""
    x32 = x.to(tl.float32)
    if OFFSET:
        return (x32 * inv_rms * (1.0 + weight.to(tl.float32))).to(x.dtype)
    normed = (x32 * inv_rms).to(x.dtype)
    return (weight * normed).to(x.dtype)


@triton.jit
def summed_row(x_ptr, residual_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x + residual at `cols` (0 where not `mask`), the sum rounded to x's dtype (the
    residual stream's), or x alone."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden] (e4m3 when QUANTIZE)
    residual_out_ptr,  # [num_tokens, hidden]: x + residual (or x)
    scale_ptr,  # [num_tokens] float32: each row's scale (QUANTIZE)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    fp8_max,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the normalized row to e4m3 with its scale (`quantize_rows`)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    let_next_start(PDL)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_for_previous(PDL)
    x = summed_row(x_ptr + row * stride_x, residual_ptr + row * stride_r, cols, mask,
                   HAS_RESIDUAL)  # fmt: skip
    tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    normed = rms_normalize(x, weight, hidden, eps, OFFSET)
    if QUANTIZE:
        normed, scale = quantized_row(normed.to(tl.float32), fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [num_tokens, hidden] (`offset`:
    times 1 + weight, Gemma's)."""
    out = torch.empty_like(x)
    return out, _add_rms_norm(x, residual, weight, eps, offset, out, None)


def add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> tuple[QuantizedRows, torch.Tensor]:
    """`add_rms_norm` with the normalized rows quantized in the same kernel, as the FP8 layer
    after it would quantize them (`quantize_rows`, bit for bit)."""
    values, scales = _empty_rows(x.shape[0], x.shape[1], x.device)
    residual_out = _add_rms_norm(x, residual, weight, eps, offset, values, scales)
    return QuantizedRows(values, scales, x.dtype), residual_out


def _empty_rows(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for rows quantized to e4m3 [rows, cols] and their scales [rows, 1]."""
    values = torch.empty((rows, cols), dtype=FP8, device=device)
    return values, torch.empty((rows, 1), dtype=torch.float32, device=device)


def _add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
    out: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """Fills `out` (and `scales`, quantizing); returns x + residual."""
    num_tokens, hidden = x.shape
    residual_out = torch.empty_like(x)
    if num_tokens == 0:
        return residual_out
    source = residual if residual is not None else x
    pdl = dependent_launch_args(x.device)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        source,
        weight,
        out,
        residual_out,
        scales if scales is not None else out,
        x.stride(0),
        source.stride(0),
        out.stride(0),
        residual_out.stride(0),
        hidden,
        eps,
        FP8_MAX,
        _MIN_SCALE,
        HAS_RESIDUAL=residual is not None,
        OFFSET=offset,
        QUANTIZE=scales is not None,
        BLOCK=next_power_of_2(hidden),
        **pdl,
        num_warps=NORM_WARPS,
    )
    return residual_out


@triton.jit
def _rms_norm_heads_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim], any token and head strides
    weight_ptr,  # [head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim] contiguous
    stride_t,
    stride_h,
    num_heads,
    head_dim,
    eps,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    let_next_start(PDL)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + token * stride_t + head * stride_h + cols, mask=mask, other=0.0)
    row = token * num_heads + head
    normed = rms_normalize(x, weight, head_dim, eps, OFFSET)
    tl.store(out_ptr + row * head_dim + cols, normed, mask=mask)


def rms_norm_heads(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> torch.Tensor:
    """RMSNorm over each head of x [num_tokens, num_heads, head_dim] (Qwen3's q and k norms;
    x may be a strided view of the fused QKV output); a contiguous result."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1, "the head dimension must be contiguous"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    pdl = dependent_launch_args(x.device)
    if num_tokens:
        _rms_norm_heads_kernel[(num_tokens, num_heads)](
            x,
            weight,
            out,
            x.stride(0),
            x.stride(1),
            num_heads,
            head_dim,
            eps,
            OFFSET=offset,
            BLOCK=next_power_of_2(head_dim),
            **pdl,
        )
    return out


@triton.jit
def gated_product(gate, up, GELU_TANH: tl.constexpr):
    """act(gate) x up in float32, each factor rounded to the activations' dtype (gate's) as
    torch computes it: act SiLU, or GELU with the tanh approximation (Gemma's GeGLU)."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    if GELU_TANH:
        # 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3)
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = rounded(gate / (1.0 + tl.exp(-2.0 * y)), dtype)
    else:
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    return rounded(act * up.to(tl.float32), dtype)


@triton.jit
def _act_and_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * inner]: gate, then up
    out_ptr,  # [num_tokens, inner] (e4m3 when QUANTIZE)
    scale_ptr,  # [num_tokens] float32: each row's scale (QUANTIZE)
    stride_in,
    stride_out,
    inner,
    fp8_max,
    min_scale,
    GELU_TANH: tl.constexpr,  # GELU (tanh approximation) instead of SiLU: Gemma's GeGLU
    QUANTIZE: tl.constexpr,  # the row to e4m3 with its scale (`quantize_rows`): BLOCK >= inner
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    let_next_start(PDL)
    wait_for_previous(PDL)
    dtype = gate_up_ptr.dtype.element_ty  # (the activations' own: what the products round to)
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inner + cols, mask=mask, other=0.0)
    out = gated_product(gate, up, GELU_TANH).to(dtype)
    if QUANTIZE:
        out, scale = quantized_row(out.to(tl.float32), fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[num_tokens, 2 * inner] -> [num_tokens, inner]: act(gate) * up, act SiLU or gelu_tanh."""
    out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    _act_and_mul(gate_up, activation, out, None)
    return out


def act_and_mul_fp8(gate_up: torch.Tensor, activation: str = "silu") -> QuantizedRows:
    """`act_and_mul` with each row quantized in the same kernel, as the FP8 layer after it
    would quantize it (`quantize_rows`, bit for bit): a program takes a whole row."""
    values, scales = _empty_rows(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.device)
    _act_and_mul(gate_up, activation, values, scales)
    return QuantizedRows(values, scales, gate_up.dtype)


def _act_and_mul(
    gate_up: torch.Tensor, activation: str, out: torch.Tensor, scales: torch.Tensor | None
) -> None:
    num_tokens, inner = out.shape
    if num_tokens == 0:
        return
    assert gate_up.stride(1) == 1, "the feature dimension must be contiguous"
    # (quantizing, a program takes the whole row for its largest magnitude)
    block = next_power_of_2(inner) if scales is not None else min(1024, next_power_of_2(inner))
    pdl = dependent_launch_args(gate_up.device)
    _act_and_mul_kernel[(num_tokens, cdiv(inner, block))](
        gate_up,
        out,
        scales if scales is not None else out,
        gate_up.stride(0),
        out.stride(0),
        inner,
        FP8_MAX,
        _MIN_SCALE,
        GELU_TANH=activation == "gelu_tanh",
        QUANTIZE=scales is not None,
        BLOCK=block,
        **pdl,
        num_warps=max(4, min(16, block // 1024)),
    )
