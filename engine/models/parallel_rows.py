"""The tensor-parallel seams of a decoder layer: a row-parallel layer's partial sums, their sum
over the ranks, and the residual add + RMSNorm after them (in the all-reduce's kernel, or handed
to the layer after: `RMSNorm.forward_for`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.engine.layers.linear import UnnormalizedRow
from kvfleet.engine.layers.quantization.fp8 import QuantizedRows
from kvfleet.engine.layers.quantization.linear import layer_bias, linear_without_bias
from kvfleet.engine.layers.torch_layers import RMSNorm

if TYPE_CHECKING:
    from kvfleet.engine.parallel.group import TPGroup


def row_parallel(
    linear: nn.Module, x: torch.Tensor | QuantizedRows, tp: TPGroup | None
) -> torch.Tensor:
    """A linear layer whose input features are split over the ranks: this rank's partial sum
    (the bias, replicated, added on rank 0 only). `reduce_and_norm` sums the ranks' parts.
    (Rows already quantized come only without tensor parallelism.)"""
    if tp is None:
        out: torch.Tensor = linear(x)
        return out
    assert isinstance(x, torch.Tensor)
    out = linear_without_bias(linear, x)
    bias = layer_bias(linear)
    return out + bias if bias is not None and tp.rank == 0 else out


def reduce_and_norm(
    norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None, tp: TPGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm(hidden, residual)`, where with tensor parallelism `hidden` is each rank's partial
    sum (a row-parallel layer's output): summed over the ranks first, in the norm's kernel when
    peer memory allows."""
    if tp is None:
        normed: tuple[torch.Tensor, torch.Tensor] = norm(hidden, residual)
        return normed
    return tp.all_reduce_add_rms_norm(hidden, residual, norm)


def norm_for(
    norm: RMSNorm,
    layer: nn.Module | None,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    tp: TPGroup | None,
) -> tuple[torch.Tensor | QuantizedRows | UnnormalizedRow, torch.Tensor]:
    """`reduce_and_norm` for the input of `layer`: without tensor parallelism, quantized in the
    norm's kernel where an FP8 layer takes its rows so (`RMSNorm.forward_for`)."""
    if tp is None:
        return norm.forward_for(layer, hidden, residual)
    return tp.all_reduce_add_rms_norm(hidden, residual, norm)


def whole(partial: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A row-parallel layer's output summed over the ranks."""
    return partial if tp is None else tp.all_reduce(partial)
