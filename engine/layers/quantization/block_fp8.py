"""Block-scaled FP8 (e4m3) linear layers (DeepSeek's and Qwen's FP8 releases, llm-compressor's
block scheme): a scale per 128 x 128 tile of the weight, activations scaled per token and 128
input columns; a Triton GEMM applies both scales per tile of the reduction
(`triton_fp8.block_fp8_matmul`). The torch reference beside it (`block_fp8_reference`)
dequantizes both sides and multiplies in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.layers.quantization.fp8 import (
    _MIN_SCALE,
    FP8,
    FP8_MAX,
    expect_fp8,
    quantize_rows,
)
from kvfleet.engine.layers.quantization.linear import QuantizedLinear, Rows, expect_shape


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` [rows, cols] in groups of `group` columns (cols divisible by it), each
    group to e4m3 with its own scale: (values [rows, cols], scales [rows, cols / group])."""
    rows, cols = x.shape
    values, scales = quantize_rows(x.reshape(rows * cols // group, group))
    return values.reshape(rows, cols), scales.reshape(rows, cols // group)


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] (in divisible by block[1]) to e4m3 with a scale per `block` tile:
    (values, scales [ceil(out / block[0]), in / block[1]])."""
    rows, cols = weight.shape
    tiles = -(-rows // block[0])
    padded = torch.zeros(tiles * block[0], cols, dtype=torch.float32, device=weight.device)
    padded[:rows] = weight.float()
    grid = padded.reshape(tiles, block[0], cols // block[1], block[1]).transpose(1, 2)
    amax = grid.abs().amax(dim=(2, 3)).clamp_min(_MIN_SCALE)
    scales = amax / FP8_MAX
    values = (grid / scales[:, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    values = values.transpose(1, 2).reshape(tiles * block[0], cols)[:rows]
    return values, scales


def block_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The torch reference of a block-scaled FP8 layer: `x` quantized per token and
    `block[1]` columns as the layer does, both sides dequantized, multiplied in float32."""
    x_q, x_scale = quantize_groups(x, block[1])
    x_deq = x_q.float() * x_scale.repeat_interleave(block[1], dim=1)
    out = x_deq @ dequantize_blocks(weight, weight_scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_blocks(
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """A block-scaled e4m3 weight [out, in] in float32."""
    rows, cols = weight.shape
    scale = weight_scale.repeat_interleave(block[0], dim=0)[:rows]
    return weight.float() * scale.repeat_interleave(block[1], dim=1)[:, :cols]


class BlockFp8Linear(QuantizedLinear):
    """Weights e4m3 [out, in] with a float32 scale per `block` = (rows, cols) tile
    (`weight_scale_inv` in the fp8 format, `weight_scale` in compressed-tensors; either way
    multiplied); inputs quantized per token and `block[1]` columns on each call."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        block: tuple[int, int],
        scale_name: str = "weight_scale_inv",
        online: bool = False,
    ):
        super().__init__()
        if block[1] < 16 or block[1] & (block[1] - 1):
            raise ValueError(f"block FP8 needs a power-of-two block of 16 or more columns: {block}")
        if in_features % block[1]:
            raise ValueError(
                f"a block-scaled FP8 layer needs input features divisible by the block's "
                f"{block[1]} columns, got {in_features}"
            )
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.block = block
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(-(-out_features // block[0]), in_features // block[1], dtype=torch.float32),
            requires_grad=False,
        )
        self.make_bias(bias)
        self.scale_name = scale_name
        self.online = online

    def checkpoint_parts(self) -> tuple[str, ...]:
        parts: tuple[str, ...] = ("weight",) if self.online else ("weight", self.scale_name)
        return parts + (("bias",) if self.bias is not None else ())

    def load_part(self, kind: str, tensor: torch.Tensor, rows: Rows, name: str) -> None:
        start, count = rows if rows is not None else (0, self.out_features)
        block_rows = self.block[0]
        if kind in ("weight", self.scale_name) and start % block_rows:
            raise ValueError(
                f"checkpoint tensor {name!r} starts at row {start} of a fused layer, not on "
                f"a {block_rows}-row block boundary: its scales cannot be placed"
            )
        blocks = -(-count // block_rows)
        if kind == "weight":
            expect_shape(name, tensor, (count, self.in_features))
            if self.online:
                values, scales = quantize_blocks(tensor.to(self.weight.device), self.block)
                self.weight.data.narrow(0, start, count).copy_(values)
                self.weight_scale.data.narrow(0, start // block_rows, blocks).copy_(scales)
                return
            expect_fp8(name, tensor)
            self.weight.data.narrow(0, start, count).copy_(tensor)
        elif kind == self.scale_name and not self.online:
            expect_shape(name, tensor, (blocks, self.in_features // self.block[1]))
            self.weight_scale.data.narrow(0, start // block_rows, blocks).copy_(tensor)
        else:
            self.load_bias_or_refuse(kind, tensor, rows, name)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        bias = self.bias if with_bias else None
        if x2.is_cuda:
            from kvfleet.engine.layers.quantization.triton_fp8 import (
                block_fp8_matmul,
                quantize_groups_triton,
            )

            x_q, x_scale = quantize_groups_triton(x2.contiguous(), self.block[1])
            out = block_fp8_matmul(x_q, x_scale, self.weight, self.weight_scale, self.block)
            out = out.to(x.dtype) if bias is None else (out + bias.float()).to(x.dtype)
        else:
            out = block_fp8_reference(x2, self.weight, self.weight_scale, self.block, bias)
        return out.reshape(*shape[:-1], self.out_features)
