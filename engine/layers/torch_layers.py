"""Layers shared by the Llama family: RMSNorm with fused residual add, rotary embeddings, SiLU·mul.

Each matches Hugging Face transformers' numerics (float32 statistics, cast back to the model dtype).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers import linear
from kvfleet.engine.layers.linear import Linear, UnnormalizedRow
from kvfleet.engine.layers.moe import SparseMoeBlock
from kvfleet.engine.layers.quantization.fp8 import (
    Fp8Linear,
    QuantizedRows,
    takes_quantized_rows,
)


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, fused: bool = False, offset: bool = False
    ) -> None:
        """`offset`: Gemma's norm, times (1 + weight) in float32, rounded once (its weights
        are stored as the offsets)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused  # one Triton kernel on CUDA instead of the torch chain below
        self.offset = offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize `x + residual`; returns (normalized, the new residual)."""
        if self.fused and x.is_cuda:
            from kvfleet.engine.layers import triton_layers

            if x.dim() == 3 and residual is None:  # [num_tokens, heads, head_dim]: per head
                normed = triton_layers.rms_norm_heads(x, self.weight, self.eps, self.offset)
                return normed, x
            return triton_layers.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        if residual is not None:
            x = x + residual
        residual = x
        # [num_tokens, hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype), residual
        return self.weight * x32.to(x.dtype), residual

    def forward_for(
        self, layer: nn.Module | None, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | QuantizedRows | UnnormalizedRow, torch.Tensor]:
        """`forward`, the normalized rows handed to `layer` (the one after) quantized by the
        norm's kernel where it takes them so (`takes_quantized_rows`), or one row handed
        unnormalized for the layer's GEMV to normalize (`takes_norm`; the residual it
        returns is written by that GEMV)."""
        if self.fused and takes_norm(layer, x):
            residual_out = torch.empty_like(x)
            row = UnnormalizedRow(
                x.contiguous(), residual, self.weight, self.eps, self.offset, residual_out
            )
            return row, residual_out
        if self.fused and takes_quantized_rows(layer, x):
            from kvfleet.engine.layers import triton_layers

            return triton_layers.add_rms_norm_fp8(x, residual, self.weight, self.eps, self.offset)
        normed: tuple[torch.Tensor, torch.Tensor] = self(x, residual)
        return normed


def takes_norm(layer: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether the RMSNorm producing `layer`'s input from `x` [rows, hidden] should be left to
    the layer's one-row GEMV (`UnnormalizedRow`): one row on CUDA of at most
    NORM_GEMV_MAX_INPUTS values, into a layer (not wrapped, e.g. by LoRA, which needs the
    normalized row) whose forward runs the Triton GEMV: bf16/fp16 weights where
    `Linear.uses_triton_gemv`, e4m3 weights always."""
    if not (
        linear.NORM_IN_GEMV
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.shape[1] <= linear.NORM_GEMV_MAX_INPUTS
    ):
        return False
    if type(layer) is Linear:
        return layer.uses_triton_gemv(x)
    if isinstance(layer, SparseMoeBlock):
        return layer.takes_unnormalized(x)
    return type(layer) is Fp8Linear


def act_and_mul(
    gate_up: torch.Tensor, fused: bool = False, activation: str = "silu"
) -> torch.Tensor:
    """[num_tokens, 2 * d] -> [num_tokens, d]: act(gate) * up, act SiLU or GELU with the tanh
    approximation (Gemma); one Triton kernel if `fused`."""
    if fused and gate_up.is_cuda:
        from kvfleet.engine.layers import triton_layers

        return triton_layers.act_and_mul(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return nn.functional.gelu(gate, approximate="tanh") * up
    return nn.functional.silu(gate) * up


def rope_inv_freq(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, with linear, llama3 or YaRN scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are scaled down by `factor`, short ones kept, the middle blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    if scaling["rope_type"] == "longrope":  # (Phi-3: a factor per frequency, long or short)
        factors = scaling["long_factor" if scaling.get("long") else "short_factor"]
        if len(factors) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE has {len(factors)} factors for {rotary_dim // 2} frequencies"
            )
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    raise ValueError(f"unsupported rope scaling {scaling['rope_type']!r}")


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: Mapping[str, Any]
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn many times over the original context keep
    their frequency, those that turn less than once are interpolated by `factor`, a linear
    ramp between (beta_fast, beta_slow rotations; the range rounded outward unless `truncate`
    is false)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = (
        dim_of(float(scaling.get("beta_fast") or 32)),
        dim_of(float(scaling.get("beta_slow") or 1)),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    steps = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((steps - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by: their `attention_factor`, else YaRN's
    0.1 ln(factor) + 1 (or DeepSeek's mscale ratio), LongRoPE's sqrt(1 + ln(factor) /
    ln(original context)); 1.0 for the other scalings."""
    if scaling is None or scaling.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


# Heads whose halves are no power of two (Phi-3's 96) through the Triton RoPE kernels too, their
# lanes padded to one and masked (and rotated in the bf16 qkv GEMV at batch 1), not the torch
# chain (~25 us a layer of torch RoPE and cache-write kernels on Phi-3-mini's batch-1 path, call
# 120). Phi-3-mini batch 1 (H200, call 121, two rounds) 3.472 / 3.477 -> 2.450 / 2.449 ms a token
# (~51% -> ~73% of its floor); Llama-3-8B unchanged (3.941 -> 3.942; bench/RESULTS.md session 47).
ROTARY_ANY_HEAD = True


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin cached per position in float32."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: Mapping[str, Any] | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # One Triton kernel per tensor on CUDA (its lanes a power of two, or any head with
        # ROTARY_ANY_HEAD).
        half = head_dim // 2
        self.fused = fused and (ROTARY_ANY_HEAD or half & (half - 1) == 0)
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        # [max_position, head_dim / 2] each. NOTE: plain attributes computed on the CPU, not
        # buffers, so a model built on the meta device keeps them; moved on first use.
        attention_factor = rope_attention_factor(scaling)
        self.cos_cache = freqs.cos() * attention_factor
        self.sin_cache = freqs.sin() * attention_factor

    def caches(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_position, head_dim / 2] on `device` (moved there on first use)."""
        if self.cos_cache.device != device:
            self.cos_cache = self.cos_cache.to(device)
            self.sin_cache = self.sin_cache.to(device)
        return self.cos_cache, self.sin_cache

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, Hq, D], k [num_tokens, Hkv, D]."""
        self.caches(positions.device)
        if self.fused and q.is_cuda:
            from kvfleet.engine.layers.triton_rope import rotary_inplace

            together = _heads_together(q, k)
            for x in (q, k) if together is None else (together,):
                rotary_inplace(x, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].repeat(1, 2)[:, None, :].to(q.dtype)
        sin = self.sin_cache[positions].repeat(1, 2)[:, None, :].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [num_tokens, Hq + Hkv, D] view when k's heads follow q's in memory (both
    slices of one fused QKV output), so one kernel rotates both."""
    num_tokens, num_heads, head_dim = q.shape
    adjacent = (
        q.stride() == k.stride()
        and q.stride(1) == head_dim
        and k.data_ptr() == q.data_ptr() + num_heads * head_dim * q.element_size()
    )
    if not adjacent:
        return None
    return q.as_strided((num_tokens, num_heads + k.shape[1], head_dim), (q.stride(0), head_dim, 1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
