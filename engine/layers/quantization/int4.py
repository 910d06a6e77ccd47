"""INT4 weight-only (W4A16) weights as AWQ and GPTQ checkpoints publish them, read into one
layout: 4-bit values packed eight to an int32 along the input dimension ([K / 8, N], GPTQ's
order), a scale and a zero point per group of `group_size` input rows ([K / g, N]; the zero
in integer units, a float so that GGUF's Q4_1 offsets fit too), and for GPTQ's act-order
checkpoints the permutation of the input that makes the groups contiguous.

    w[k, n] = (q[k, n] - zero[k // g, n]) * scale[k // g, n];  y = x[:, perm] @ w

The published layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them:
- GPTQ: `qweight` int32 [K / 8, N], value k at bits 4 (k % 8) of row k // 8; `qzeros` int32
  [K / g, N / 8], column n at bits 4 (n % 8); `scales` [K / g, N]; `g_idx` int32 [K] (the group
  of each input row; not k // g when `desc_act`). The original format stores each zero minus
  one (`checkpoint_format` "gptq"); "gptq_v2" stores it as it is. Symmetric: zero 8.
- AWQ (GEMM): `qweight` int32 [K, N / 8] packed along the output dimension in the order
  0, 2, 4, 6, 1, 3, 5, 7 (bits 4 i hold column AWQ_ORDER[i] of each eight); `qzeros` int32
  [K / g, N / 8] the same way; `scales` [K / g, N].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values along dim 0 -> int32 [8 R, C] (0..15)."""
    values = (packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return values.reshape(packed.shape[0] * 8, packed.shape[1])


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] holding eight 4-bit values along dim 1 -> int32 [R, 8 C]; `order`: the
    column each nibble holds within its eight (AWQ's interleave), default in sequence."""
    nibbles = (packed[:, :, None] >> _SHIFTS.to(packed.device)[None, None, :]) & 0xF
    if order is not None:
        placed = torch.empty_like(nibbles)
        placed[:, :, list(order)] = nibbles
        nibbles = placed
    return nibbles.reshape(packed.shape[0], packed.shape[1] * 8)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [8 R, C] of 0..15 -> int32 [R, C], eight values along dim 0 per int32."""
    rows, cols = values.shape
    grouped = values.to(torch.int32).reshape(rows // 8, 8, cols)
    shifted = grouped << _SHIFTS.to(values.device)[None, :, None]
    packed = shifted[:, 0]
    for i in range(1, 8):
        packed = packed | shifted[:, i]
    return packed


@dataclass
class Int4Weights:
    """One linear layer's 4-bit weights in kvfleet's layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # [K / g, N], the activations' dtype
    zeros: torch.Tensor  # [K / g, N], in integer units (float)
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]: x[:, perm] meets the rows in group order

    def dequantize(self) -> torch.Tensor:
        """w [K, N] in float32, in the (permuted) row order of `qweight`."""
        q = unpack_rows(self.qweight).float()
        g = self.group_size
        scales = self.scales.float().repeat_interleave(g, dim=0)
        zeros = self.zeros.float().repeat_interleave(g, dim=0)
        return (q - zeros) * scales


def int4_linear_reference(
    x: torch.Tensor, weights: Int4Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: the weight dequantized, multiplied in float32; out in x's dtype."""
    if weights.perm is not None:
        x = x[..., weights.perm]
    out = x.float() @ weights.dequantize()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int = 1,
) -> Int4Weights:
    """A GPTQ layer's tensors (`zero_offset` 1 for the original checkpoint format, 0 for
    gptq_v2). With act-order (`g_idx` not k // g) the input rows are sorted by group."""
    k = qweight.shape[0] * 8
    values = unpack_rows(qweight)
    zeros = (unpack_columns(qzeros) + zero_offset).to(scales.dtype)
    perm = None
    if g_idx is not None and not torch.equal(
        g_idx.long(), torch.arange(k, device=g_idx.device) // group_size
    ):
        perm = torch.sort(g_idx.long(), stable=True).indices
        sorted_groups = g_idx.long()[perm]
        if not torch.equal(sorted_groups, torch.arange(k, device=g_idx.device) // group_size):
            raise ValueError(f"a GPTQ g_idx must give each group exactly {group_size} input rows")
        values = values[perm]
    return Int4Weights(pack_rows(values), scales, zeros, group_size, perm)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Weights:
    """An AWQ (GEMM) layer's tensors."""
    values = unpack_columns(qweight, AWQ_ORDER)
    zeros = unpack_columns(qzeros, AWQ_ORDER).to(scales.dtype)
    return Int4Weights(pack_rows(values), scales, zeros, group_size)
