"""The model's unquantized linear layer: `nn.Linear`, except that a one-row product (decode of one
sequence) of a bf16/fp16 weight on Hopper goes through the Triton GEMV
(engine/layers/triton_gemv.py) when the weight is small enough that cuBLAS's GEMV spends a
large part of its time starting rather than streaming: launched dependent, the Triton one
fetches its first weight tile while the kernel before it finishes (bench/gemv_chain.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.layers.dependent_launch import dependent_launch

# Weights up to this size take the Triton GEMV for one row (Llama-3-8B: qkv 50 MB and o 34 MB
# do; gate_up 235 MB and down 117 MB, where cuBLAS streams at ~97% of the copy rate, do not).
TRITON_GEMV_MAX_BYTES = 64 << 20
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.uses_triton_gemv(x):
            from kvfleet.engine.layers.triton_gemv import gemv

            out = gemv(x.reshape(1, self.in_features).contiguous(), self.weight, bias=self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def uses_triton_gemv(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` runs the Triton GEMV: one row, a bf16/fp16 weight of at most
        TRITON_GEMV_MAX_BYTES, contiguous, on a device that launches dependent."""
        weight = self.weight
        return (
            x.numel() == self.in_features
            and weight.dtype in _GEMV_DTYPES
            and x.dtype == weight.dtype
            and weight.numel() * weight.element_size() <= TRITON_GEMV_MAX_BYTES
            and weight.is_contiguous()
            and dependent_launch(x.device)
        )
