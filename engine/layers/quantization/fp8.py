"""FP8 (e4m3) W8A8 linear layers: weights quantized per output channel, activations per token
at run time, the product in one scaled GEMM (`torch._scaled_mm`: cuBLASLt on Hopper) with the
scales applied in its epilogue. The torch reference beside it (`fp8_linear_reference`)
dequantizes and multiplies in float32: what the scaled GEMM must match.

Block-scaled FP8 (DeepSeek's and Qwen's FP8 releases): `block_fp8.BlockFp8Linear`.

Numbers: e4m3 keeps 3 mantissa bits (a relative step of 2^-3 at worst, ~3% mean error on a
Gaussian), its largest finite value is 448; each row's scale maps its largest magnitude there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.engine.layers.linear import SplitRows, UnnormalizedRow, gemv_rotated
from kvfleet.engine.layers.quantization.linear import QuantizedLinear, Rows, expect_shape

if TYPE_CHECKING:
    from kvfleet.engine.layers.triton_rope import RotaryWrite

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # (an all-zero row keeps a finite scale)
# The norm and SiLU x mul before an FP8 layer quantize its rows in their own kernels
# (`takes_quantized_rows`); False: the layer quantizes them in a pass of its own (for A/B).
QUANTIZE_IN_PRODUCER = True
# Row counts whose GEMM runs in Triton (`triton_fp8.fp8_gemm`) instead of cuBLASLt's scaled
# GEMM: where bench/fp8_gemm.py measured it faster on the H200 (Llama-3-8B's four layers at
# 16-64 rows: 95-98 us against 113-118 in session 25; sums promoted to float32, 97.7 us at 16
# rows in session 26; from 128 rows cuBLASLt is as fast or faster). One row: the GEMV.
TRITON_GEMM_ROWS = range(2, 65)
# Row counts whose GEMM runs as the tensor-core GEMV over rows quantized already
# (`triton_gemv.fp8_rows_mma`: K split over the SMs as for one row), before TRITON_GEMM_ROWS.
# bench/fp8_gemm.py on the H200 (bench/RESULTS.md "2026-11-28 (session 26)"): the four
# Llama-3-8B layers at 2 / 8 / 16 rows 80.6-85.6 us against the Triton GEMM's 95.6-97.7 (gate_up
# alone slower, 40.6-41.3 against 32.2-32.6); at 32 rows qkv and o are slower this way, at 64
# all four: which layers take it, `rows_mma_pays`.
MMA_GEMV_ROWS = range(2, 33)


def fp8_supported(device: torch.device) -> str | None:
    """None if FP8 GEMMs run on `device`, else why not (what is supported)."""
    if device.type != "cuda":
        return (
            f"FP8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper), not {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (
            f"FP8 needs compute capability 8.9 or newer (Ada, Hopper); {name} has {major}.{minor}"
        )
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` [rows, cols] to e4m3 with its own scale: (values, scales [rows, 1]
    float32), x ≈ values * scales."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_MIN_SCALE)
    scales = amax / FP8_MAX
    return to_e4m3(x, scales), scales


def to_e4m3(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x's values over their row's scale, saturated, as e4m3: times the scale's reciprocal (one
    IEEE division a row, as vLLM's quantizers do; every kernel here computes it so, bit for
    bit: an IEEE division a value made the quantizing kernels instruction-bound)."""
    return (x.float() * (1.0 / scales)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations already quantized per row (as `quantize_rows` does) by the kernel that
    produced them (the norm or SiLU x mul before an FP8 layer): e4m3 `values` [rows, cols],
    `scales` [rows, 1] float32, `dtype` the activations' own (the layer's output dtype)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def takes_quantized_rows(layer: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether the kernel producing `x` [rows, cols] should hand `layer` its rows quantized
    (`QuantizedRows`) instead of writing them in x's dtype for the layer to quantize: an FP8
    layer with dynamic per-row scales (not wrapped, e.g. by LoRA, which needs the rows as they
    are), on CUDA, for more than one row (one row goes to the GEMV, which quantizes inside)."""
    return (
        QUANTIZE_IN_PRODUCER
        and type(layer) is Fp8Linear
        and layer.input_scale is None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] > 1
    )


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The torch reference: `x` quantized per token as the layer does, both sides dequantized,
    multiplied in float32; out in `x`'s dtype."""
    x_q, x_scale = quantize_rows(x)
    out = (x_q.float() * x_scale) @ (weight.float() * weight_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Fp8Linear(QuantizedLinear):
    """Weights e4m3 [out, in] with a float32 scale per output channel; inputs (the model's
    dtype) quantized per token on each call, or with the checkpoint's static scale.

    `online`: filled from a bf16/fp16/fp32 checkpoint, each output row quantized as it loads
    (so a fused layer's parts quantize alike whole or apart). A checkpoint's per-tensor weight
    scale is spread over the rows it covers (exact: one scale per row is finer)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        static_input: bool = False,
        online: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.online = online
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False
        )
        self.input_scale = (
            nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
            if static_input
            else None
        )
        self.make_bias(bias)
        self._input_scale_seen: float | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized online: its weight per output channel."""
        weight = linear.weight.detach()
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, weight.dtype, False,
            online=True,
        ).to(weight.device)  # fmt: skip
        with torch.no_grad():
            layer.load_part("weight", weight, None, "weight")
            if linear.bias is not None:
                layer.load_part("bias", linear.bias.detach(), None, "bias")
        return layer

    def checkpoint_parts(self) -> tuple[str, ...]:
        parts: tuple[str, ...] = ("weight",) if self.online else ("weight", "weight_scale")
        if self.input_scale is not None:
            parts += ("input_scale",)
        return parts + (("bias",) if self.bias is not None else ())

    def load_part(self, kind: str, tensor: torch.Tensor, rows: Rows, name: str) -> None:
        start, count = rows if rows is not None else (0, self.out_features)
        if kind == "weight":
            expect_shape(name, tensor, (count, self.in_features))
            if self.online:
                values, scales = quantize_rows(tensor.to(self.weight.device))
                self.weight.data.narrow(0, start, count).copy_(values)
                self.weight_scale.data.narrow(0, start, count).copy_(scales)
                return
            expect_fp8(name, tensor)
            self.weight.data.narrow(0, start, count).copy_(tensor)
        elif kind == "weight_scale" and not self.online:
            dest = self.weight_scale.data.narrow(0, start, count)
            if tensor.numel() == 1:  # (per-tensor)
                dest.fill_(float(tensor.reshape(())))
            else:
                expect_shape(name, tensor.reshape(-1, 1), (count, 1))
                dest.copy_(tensor.reshape(-1, 1))
        elif kind == "input_scale" and self.input_scale is not None:
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r}: a static input scale is one value")
            value = float(tensor.reshape(()))  # (fused parts share their input: the largest)
            seen = self._input_scale_seen
            self._input_scale_seen = value if seen is None else max(seen, value)
            self.input_scale.data.fill_(self._input_scale_seen)
        else:
            self.load_bias_or_refuse(kind, tensor, rows, name)

    def finish_loading(self) -> None:
        if self.weight.is_cuda:  # (the one-row GEMV's split-K room, before any graph capture)
            from kvfleet.engine.layers.triton_gemv import reserve_fp8_gemv

            reserve_fp8_gemv(self.out_features, self.in_features, self.weight.device)

    def takes_split_rows(self, x: torch.Tensor, head_dim: int) -> bool:
        """Whether the one-row GEMV merges decode attention's unmerged splits of heads of
        `head_dim` for this row x (`linear.takes_splits`): where it multiplies the row as it is
        (`triton_gemv.FP8_BF16_ROW`), heads of a power of two."""
        from kvfleet.engine.layers import triton_gemv

        return (
            triton_gemv.FP8_BF16_ROW
            and x.is_cuda
            and x.dtype == self.dtype
            and head_dim & (head_dim - 1) == 0
        )

    def forward(
        self, x: torch.Tensor | QuantizedRows | UnnormalizedRow | SplitRows, with_bias: bool = True
    ) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if isinstance(x, QuantizedRows):  # (quantized by the kernel that produced them)
            return self._scaled_mm(x.values, x.scales, bias, x.dtype)
        shape = x.shape
        if isinstance(x, (UnnormalizedRow, SplitRows)) or (x.is_cuda and x.numel() == shape[-1]):
            # (decode of one sequence: one kernel quantizes the row, normalizing it first if
            # asked, and streams the weight)
            from kvfleet.engine.layers.triton_gemv import gemv

            row = (
                x if isinstance(x, (UnnormalizedRow, SplitRows)) else x.reshape(1, -1).contiguous()
            )
            out = gemv(row, self.weight, self.weight_scale, bias, self.input_scale)
            return out.reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is not None:
            x_scale = self.input_scale.expand(x2.shape[0], 1)
            x_q = to_e4m3(x2, x_scale)
        elif x2.is_cuda:  # (one Triton pass instead of five torch ones)
            from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton

            x_q, x_scale = quantize_rows_triton(x2.contiguous())
        else:
            x_q, x_scale = quantize_rows(x2)
        out = self._scaled_mm(x_q, x_scale, bias, x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def forward_rotated(
        self, x: torch.Tensor | UnnormalizedRow, rotary: RotaryWrite
    ) -> torch.Tensor | None:
        """`Linear.forward_rotated` through the e4m3 one-row GEMV."""
        takes = isinstance(x, torch.Tensor) and x.is_cuda and x.numel() == x.shape[-1]
        return gemv_rotated(
            x, takes, rotary, self.weight, self.weight_scale, self.bias, self.input_scale
        )

    def _scaled_mm(
        self,
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[rows, out] in `dtype` from e4m3 rows `x_q` and their scales [rows, 1]."""
        if x_q.is_cuda and x_q.shape[0] in MMA_GEMV_ROWS:
            from kvfleet.engine.layers.triton_gemv import fp8_rows_mma, rows_mma_pays

            n, k = self.weight.shape
            if rows_mma_pays(n, k, x_q.device, x_q.shape[0]):
                return fp8_rows_mma(x_q, x_scale, self.weight, self.weight_scale, bias, dtype)
        if x_q.is_cuda and x_q.shape[0] in TRITON_GEMM_ROWS:
            from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm

            return fp8_gemm(x_q, x_scale, self.weight, self.weight_scale, bias, dtype)
        out = torch._scaled_mm(
            x_q,
            self.weight.t(),
            scale_a=x_scale.contiguous(),
            scale_b=self.weight_scale.t(),
            bias=bias if dtype != torch.float32 else None,
            out_dtype=dtype,
        )
        if bias is not None and dtype == torch.float32:
            out = out + bias  # (the scaled GEMM takes a bias only for 16-bit outputs)
        return out


def expect_fp8(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != FP8:
        raise ValueError(
            f"checkpoint tensor {name!r} is {tensor.dtype}; an FP8 checkpoint stores {FP8}"
        )
