"""Integer weight-only weights (W4A16, W8A16) as AWQ, GPTQ and GGUF files publish them, read
into one layout, GPTQ's: b-bit values (b = 4 or 8) packed P = 32 / b to an int32 along the input
dimension (`qweight` [K / P, N]: value k of column n at bits b (k % P) of row k // P; below
with b = 4, P = 8), a scale and a zero point per
group of `group_size` inputs and output column ([K / g, N]; the zero in integer units, held in
the scales' dtype so that GGUF's Q4_1 offsets fit too), and for GPTQ's act-order checkpoints
the permutation of the input that makes the groups contiguous.

    W[k, n] = (q[k, n] - zero[k // g, n]) * scale[k // g, n];  y = x[:, perm] @ W

Rows of words run along the output (N contiguous): the decode kernel reads each row of words
coalesced and many programs split K between them (triton_packed.py).

The published layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them:
- GPTQ: `qweight` int32 [K / 8, N], value k at bits 4 (k % 8) of row k // 8; `qzeros` int32
  [K / g, N / 8], column n at bits 4 (n % 8); `scales` [K / g, N]; `g_idx` int32 [K] (the group
  of each input row; not k // g when `desc_act`). The original format stores each zero minus
  one (`checkpoint_format` "gptq"); "gptq_v2" stores it as it is. Symmetric: zero 8. With
  `bits: 8` the same with four values to a word (symmetric zero 128).
- AWQ (GEMM): `qweight` int32 [K, N / 8] packed along the output dimension in the order
  0, 2, 4, 6, 1, 3, 5, 7 (bits 4 i hold column AWQ_ORDER[i] of each eight); `qzeros` int32
  [K / g, N / 8] the same way; `scales` [K / g, N].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvfleet.engine.layers.linear import SplitRows
from kvfleet.engine.layers.quantization.linear import QuantizedLinear, Rows, expect_shape
from kvfleet.engine.layers.quantization.scheme import PackedScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _shifts(device: torch.device, bits: int) -> torch.Tensor:
    # (made per call: a module-level tensor would be born on the meta device when this module
    # is first imported while a model is built there)
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values along dim 0 -> int32 [32 / bits R, C]
    (0 .. 2^bits - 1)."""
    values = (packed[:, None, :] >> _shifts(packed.device, bits)[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * 32 // bits, packed.shape[1])


def unpack_columns(
    packed: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4
) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values along dim 1 -> int32 [R, 32 / bits C]; `order`:
    the column each value holds within its word (AWQ's interleave), default in sequence."""
    values = (packed[:, :, None] >> _shifts(packed.device, bits)[None, None, :]) & ((1 << bits) - 1)
    if order is not None:
        placed = torch.empty_like(values)
        placed[:, :, list(order)] = values
        values = placed
    return values.reshape(packed.shape[0], packed.shape[1] * 32 // bits)


def pack_rows(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int [32 / bits R, C] of 0 .. 2^bits - 1 -> int32 [R, C], 32 / bits values along dim 0
    per int32 (kvfleet's `qweight` from the integer weight [K, N])."""
    rows, cols = values.shape
    per = 32 // bits
    grouped = values.to(torch.int32).reshape(rows // per, per, cols)
    shifted = grouped << _shifts(values.device, bits)[None, :, None]
    packed = shifted[:, 0]
    for i in range(1, per):
        packed = packed | shifted[:, i]
    return packed.contiguous()


@dataclass
class PackedWeights:
    """One linear layer's 4-bit (or 8-bit) weights in kvfleet's layout (see the module
    docstring)."""

    qweight: torch.Tensor  # int32 [K / (32 / bits), N]
    scales: torch.Tensor  # [K / g, N], the activations' dtype
    zeros: torch.Tensor  # [K / g, N], in integer units, the scales' dtype
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]: x[:, perm] meets the words in group order
    bits: int = 4

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 32 // self.bits

    def __post_init__(self) -> None:  # (the kernels index rows by their length)
        self.qweight = self.qweight.contiguous()
        self.scales = self.scales.contiguous()
        self.zeros = self.zeros.contiguous()

    def dequantize(self) -> torch.Tensor:
        """W [K, N] in float32, its inputs in the (permuted) order of `qweight`."""
        q = unpack_rows(self.qweight, self.bits).float()
        g = self.group_size
        scales = self.scales.float().repeat_interleave(g, dim=0)
        zeros = self.zeros.float().repeat_interleave(g, dim=0)
        return (q - zeros) * scales


def packed_linear_reference(
    x: torch.Tensor, weights: PackedWeights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: the weight dequantized, multiplied in float32; out in x's dtype."""
    if weights.perm is not None:
        x = x[..., weights.perm]
    out = x.float() @ weights.dequantize()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """GPTQ's `g_idx` (the group of each input row) -> the permutation that sorts the rows by
    group, or None where they are in order already. ValueError unless every group has exactly
    `group_size` rows."""
    k = g_idx.shape[0]
    in_order = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), in_order):
        return None
    perm = torch.sort(g_idx.long(), stable=True).indices
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError(f"a GPTQ g_idx must give each group exactly {group_size} input rows")
    return perm


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int = 1,
) -> PackedWeights:
    """A GPTQ layer's tensors (`zero_offset` 1 for the original checkpoint format, 0 for
    gptq_v2). With act-order (`g_idx` not k // g) the input rows are sorted by group."""
    values = unpack_rows(qweight)  # [K, N]
    zeros = (unpack_columns(qzeros) + zero_offset).to(scales.dtype)
    perm = act_order_permutation(g_idx, group_size) if g_idx is not None else None
    if perm is not None:
        values = values[perm]
    return PackedWeights(pack_rows(values), scales, zeros, group_size, perm)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> PackedWeights:
    """An AWQ (GEMM) layer's tensors."""
    values = unpack_columns(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_columns(qzeros, AWQ_ORDER).to(scales.dtype)
    return PackedWeights(pack_rows(values), scales, zeros, group_size)


def quantize_rtn(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> PackedWeights:
    """Round-to-nearest, asymmetric, per row and group of `group_size` inputs (the form AWQ
    loads into, without AWQ's activation-aware scaling): weight [N, K] -> PackedWeights with
    scales and zeros in `dtype`."""
    n, k = weight.shape
    grouped = weight.float().t().reshape(k // group_size, group_size, n)
    low = grouped.amin(dim=1).clamp(max=0.0)
    high = grouped.amax(dim=1).clamp(min=0.0)
    scales = ((high - low) / 15).clamp_min(1e-10).to(dtype).float()
    zeros = (-low / scales).round().clamp(0, 15)
    q = (grouped / scales[:, None, :] + zeros[:, None, :]).round().clamp(0, 15)
    return PackedWeights(pack_rows(q.reshape(k, n)), scales.to(dtype), zeros.to(dtype), group_size)


class PackedLinear(QuantizedLinear):
    """INT4 (or 8-bit: `bits`) weight-only: `qweight`, `scales`, `zeros` in packed.py's layout,
    activations in the model dtype. Filled from an AWQ or GPTQ checkpoint's tensors (each fused
    part into its output columns), a GGUF file's blocks (loader/gguf.py) or, online, from a
    bf16/fp16 weight rounded to nearest. GPTQ's act-order permutation is applied once every
    part has loaded (`finish_loading`): the parts of a fused layer share their input, so they
    must share their `g_idx`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        scheme: PackedScheme,
        bits: int = 4,
    ):
        super().__init__()
        group = in_features if scheme.group_size == -1 else scheme.group_size
        if scheme.source == "online":  # (rounded here: a smaller group where the inputs need)
            group = next((g for g in (group, 64, 32) if in_features % g == 0), group)
        if in_features % group or out_features % 8:
            raise ValueError(
                f"an INT4 layer of {in_features} inputs and {out_features} outputs cannot take "
                f"group size {group} (it must divide the inputs; outputs come in eights)"
            )
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.scheme, self.group_size, self.bits = scheme, group, bits
        groups = in_features // group
        self.qweight = nn.Parameter(
            torch.empty(in_features * bits // 32, out_features, dtype=torch.int32),
            requires_grad=False,
        )
        self.scales = nn.Parameter(
            torch.empty(groups, out_features, dtype=dtype), requires_grad=False
        )
        self.zeros = nn.Parameter(
            torch.empty(groups, out_features, dtype=dtype), requires_grad=False
        )
        self.make_bias(bias)
        self.perm: torch.Tensor | None = None
        self._g_idx: dict[int, torch.Tensor] = {}
        self._weights: PackedWeights | None = None

    def checkpoint_parts(self) -> tuple[str, ...]:
        source = self.scheme.source
        parts: tuple[str, ...] = {
            "online": ("weight",),
            "gguf": ("qweight", "scales", "zeros"),  # (kvfleet's layout: loader/gguf.py)
        }.get(source, ("qweight", "qzeros", "scales"))
        if source == "gptq" and self.scheme.act_order:
            parts += ("g_idx",)
        return parts + (("bias",) if self.bias is not None else ())

    def load_part(self, kind: str, tensor: torch.Tensor, rows: Rows, name: str) -> None:
        start, count = rows if rows is not None else (0, self.out_features)
        k, g = self.in_features, self.group_size
        source = self.scheme.source
        device = self.qweight.device
        if kind == "weight" and source == "online":
            expect_shape(name, tensor, (count, k))
            weights = quantize_rtn(tensor.to(device), g, self.dtype)
            self._fill(start, weights.qweight, weights.scales, weights.zeros)
        elif kind == "qweight" and source == "awq":
            expect_shape(name, tensor, (k, count // 8), torch.int32)
            self._fill(start, pack_rows(unpack_columns(tensor.to(device), AWQ_ORDER)))
        elif kind == "qweight" and source in ("gptq", "gguf"):
            expect_shape(name, tensor, (k * self.bits // 32, count), torch.int32)
            self._fill(start, tensor.to(device))
        elif kind == "zeros" and source == "gguf":
            expect_shape(name, tensor, (k // g, count))
            self._fill(start, zeros=tensor.to(device, self.dtype))
        elif kind == "qzeros" and source in ("awq", "gptq"):
            expect_shape(name, tensor, (k // g, count * self.bits // 32), torch.int32)
            order = AWQ_ORDER if source == "awq" else None
            zeros = unpack_columns(tensor.to(device), order, self.bits) + self.scheme.zero_offset
            self._fill(start, zeros=zeros.to(self.dtype))
        elif kind == "scales" and source != "online":
            expect_shape(name, tensor, (k // g, count))
            self._fill(start, scales=tensor.to(device, self.dtype))
        elif kind == "g_idx" and source == "gptq":
            expect_shape(name, tensor, (k,))
            self._g_idx[start] = tensor.to(device)
        else:
            self.load_bias_or_refuse(kind, tensor, rows, name)

    def _fill(
        self,
        start: int,
        qweight: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
    ) -> None:
        for dest, part in ((self.qweight, qweight), (self.scales, scales), (self.zeros, zeros)):
            if part is not None:
                dest.data.narrow(1, start, part.shape[1]).copy_(part)

    def finish_loading(self) -> None:
        self._weights = None
        g_idx = list(self._g_idx.values())
        self._g_idx = {}
        if g_idx:
            if any(not torch.equal(g_idx[0], other) for other in g_idx[1:]):
                raise ValueError(
                    "the GPTQ parts of a fused layer (q, k, v or gate, up) have different "
                    "g_idx; kvfleet runs them as one layer over one permuted input"
                )
            # (a tensor-parallel rank's share of the inputs starts at its first group)
            perm = act_order_permutation(g_idx[0] - g_idx[0].min(), self.group_size)
            if perm is not None:
                values = unpack_rows(self.qweight.data, self.bits)[perm]
                self.qweight.data.copy_(pack_rows(values, self.bits))
                self.perm = perm
        if self.qweight.is_cuda:  # (before any CUDA graph is captured)
            from kvfleet.engine.layers.quantization.triton_packed import (
                shared_workspace,
                workspace_sizes,
            )

            sizes = workspace_sizes(self.out_features, self.in_features, self.group_size, self.bits)
            shared_workspace(self.qweight.device, *sizes)

    def weights(self) -> PackedWeights:
        """The layer's tensors as the kernels take them (built once loading has finished)."""
        if self._weights is None:
            self._weights = PackedWeights(
                self.qweight.data,
                self.scales.data,
                self.zeros.data,
                self.group_size,
                self.perm,
                self.bits,
            )
        return self._weights

    def takes_split_rows(self, x: torch.Tensor, head_dim: int) -> bool:
        """Whether the one-row GEMV merges decode attention's unmerged splits of heads of
        `head_dim` for this row x (`linear.takes_splits`): no act-order, whole heads a step of
        its plan."""
        if not (x.is_cuda and x.dtype == self.dtype and self.perm is None):
            return False
        from kvfleet.engine.layers.quantization.triton_packed import splits_fit

        return splits_fit(self.out_features, self.in_features, self.group_size, head_dim)

    def forward(self, x: torch.Tensor | SplitRows, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if isinstance(x, SplitRows):  # (`takes_split_rows`)
            from kvfleet.engine.layers.quantization.triton_packed import packed_gemv

            return packed_gemv(x, self.weights(), bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            from kvfleet.engine.layers.quantization.triton_packed import packed_matmul

            out = packed_matmul(x2, self.weights(), bias)
        else:
            out = packed_linear_reference(x2, self.weights(), bias)
        return out.reshape(*shape[:-1], self.out_features)
