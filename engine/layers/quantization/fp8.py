"""FP8 (e4m3) W8A8 linear layers: weights quantized per output channel, activations per token
at run time, the product in one scaled GEMM (`torch._scaled_mm`: cuBLASLt on Hopper) with the
scales applied in its epilogue. The torch reference beside it (`fp8_linear_reference`)
dequantizes and multiplies in float32: what the scaled GEMM must match.

Numbers: e4m3 keeps 3 mantissa bits (a relative step of 2^-3 at worst, ~3% mean error on a
Gaussian), its largest finite value is 448; each row's scale maps its largest magnitude there.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # (an all-zero row keeps a finite scale)


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
    values = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scales


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


class Fp8Linear(nn.Module):
    """A linear layer whose weight is e4m3 [out, in] with a float32 scale per output channel;
    inputs (bf16/fp16/fp32) are quantized per token on each call."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(
                f"an FP8 weight is a 2-D {FP8} tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        if weight_scale.shape != (weight.shape[0], 1):
            raise ValueError(
                f"the weight scale has one value per output channel, shape ({weight.shape[0]}, 1); "
                f"got {tuple(weight_scale.shape)}"
            )
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized online: its weight per output channel."""
        weight, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:  # (one Triton pass instead of five torch ones)
            from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton

            x_q, x_scale = quantize_rows_triton(x2.contiguous())
        else:
            x_q, x_scale = quantize_rows(x2)
        out = torch._scaled_mm(
            x_q,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale.t(),
            bias=self.bias
            if with_bias and self.bias is not None and x.dtype != torch.float32
            else None,
            out_dtype=x.dtype,
        )
        if with_bias and self.bias is not None and x.dtype == torch.float32:
            out = out + self.bias  # (the scaled GEMM takes a bias only for 16-bit outputs)
        return out.reshape(*shape[:-1], self.out_features)
