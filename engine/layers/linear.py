"""The model's unquantized linear layer: `nn.Linear`, except that a one-row product (decode of one
sequence) of a bf16/fp16 weight on Hopper goes through the Triton GEMV
(engine/layers/triton_gemv.py): launched dependent, it fetches its first weight tile while the
kernel before it finishes, and it streams the large weights as fast as cuBLAS's GEMV or faster
(bench/gemv.py, H100: Llama-3-8B gate_up 78.6 against 82.5 us, down 41.3 against 44.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.engine.layers.dependent_launch import dependent_launch

if TYPE_CHECKING:
    from kvfleet.engine.layers.triton_rope import RotaryWrite

# Weights up to this size take the Triton GEMV for one row: every projection of Llama-3-8B and
# of Llama-3-70B over two GPUs (bench/gemv.py, H100: faster than cuBLAS at 9 of 11 shapes; slower
# at 70B's per-rank qkv, 33.7 against 32.9 us, and o, 27.0 against 25.4). The LM head (an
# `nn.Linear`, ~1 GB at 128k words) is not a `Linear`: see LM_HEAD_GEMV.
TRITON_GEMV_MAX_BYTES = 512 << 20
# One row's logits through the Triton GEMV (launched dependent, float32 out) instead of
# cuBLAS's float32-out matmul (`float32_logits`; False: cuBLAS, for A/B runs).
LM_HEAD_GEMV = True
_GEMV_DTYPES = (torch.bfloat16, torch.float16)
# One row's residual add and RMSNorm made by the next layer's GEMV as it reads the row
# (`UnnormalizedRow`; False: the norm's kernel before it, as before; for A/B runs), for rows
# of up to NORM_GEMV_MAX_INPUTS values (each program holds the whole row once).
NORM_IN_GEMV = True
NORM_GEMV_MAX_INPUTS = 8192
# Decode attention's splits at batch 1 left unmerged, up to this many holding keys, for the
# output projection's one-row GEMV to merge as it reads its row (`SplitRows`; 0: the attention
# kernel's last split merges them, as before; for A/B runs): their partials, counter and merge
# took 4.5 us of the attention's 8.65 a layer at Qwen3-30B-A3B (bench/RESULTS.md session 41).
SPLITS_IN_GEMV = 4
# ... also into 4/8-bit layers' split-K GEMV (`triton_packed.packed_gemv`): INT4 (RTN)
# Llama-3-8B batch 1 2.323 / 2.322 -> 2.296 / 2.295 ms (bench/RESULTS.md session 45, call 107)
SPLITS_IN_PACKED_GEMV = True


@dataclass(frozen=True)
class UnnormalizedRow:
    """One row handed to a linear layer before its RMSNorm (`RMSNorm.forward_for`), for the
    layer's one-row GEMV to make weight * RMSNorm(x + residual) as it reads it; the GEMV
    writes x + residual (the next residual) into `residual_out`."""

    x: torch.Tensor  # [1, hidden], contiguous
    residual: torch.Tensor | None  # [1, hidden]
    weight: torch.Tensor  # [hidden] the norm's
    eps: float
    offset: bool  # times 1 + weight (Gemma)
    residual_out: torch.Tensor  # [1, hidden]

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


@dataclass(frozen=True)
class SplitRows:
    """One row handed to a linear layer as decode attention left it
    (`triton_decode.decode_leaving_splits`): its heads' outputs over up to `splits` ranges of
    the keys, unmerged, for the layer's one-row GEMV to merge as it reads them. Row s of
    `parts` [splits, K] is range s's output (each head's P.V over its own softmax sum),
    lse[head, s] (float32, [heads, >= splits]) its log-sum-exp, -inf where the range holds no
    keys: row = sum over s of exp(lse_s - LSE) parts_s, head by head, LSE the log of the sum of
    the exp(lse_s)."""

    parts: torch.Tensor  # [splits, K] contiguous
    lse: torch.Tensor  # [heads, >= splits] float32, its rows contiguous

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, self.parts.shape[1]))

    @property
    def head_dim(self) -> int:
        return self.parts.shape[1] // self.lse.shape[0]


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor | UnnormalizedRow | SplitRows) -> torch.Tensor:
        if isinstance(x, (UnnormalizedRow, SplitRows)):  # (`takes_norm`, `takes_splits`)
            from kvfleet.engine.layers.triton_gemv import gemv

            return gemv(x, self.weight, bias=self.bias)
        if x.is_cuda and self.uses_triton_gemv(x):
            from kvfleet.engine.layers.triton_gemv import gemv

            out = gemv(x.reshape(1, self.in_features).contiguous(), self.weight, bias=self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def forward_rotated(
        self, x: torch.Tensor | UnnormalizedRow, rotary: RotaryWrite
    ) -> torch.Tensor | None:
        """A qkv projection's one row through the Triton GEMV that also rotates q and writes k
        and v into the cache (`gemv_rotated`): [1, out_features], its q columns valid; None
        where it does not run."""
        takes = isinstance(x, torch.Tensor) and x.is_cuda and self.uses_triton_gemv(x)
        return gemv_rotated(x, takes, rotary, self.weight, bias=self.bias)

    def uses_triton_gemv(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` runs the Triton GEMV: one row it takes (`gemv_takes`), a weight
        of at most TRITON_GEMV_MAX_BYTES."""
        weight = self.weight
        return weight.numel() * weight.element_size() <= TRITON_GEMV_MAX_BYTES and gemv_takes(
            x, weight
        )


def gemv_rotated(
    x: torch.Tensor | UnnormalizedRow,
    takes: bool,
    rotary: RotaryWrite,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`triton_gemv.gemv(rotary=...)` of a qkv projection's one row: `x` an `UnnormalizedRow`,
    or a row tensor the layer's one-row GEMV `takes`; None otherwise, or where the GEMV's
    programs' pairs of rows would not stay in one head, or a head normalized would not fit one
    tile (`triton_gemv.takes_rotary`)."""
    from kvfleet.engine.layers.triton_gemv import gemv, takes_rotary

    if not takes_rotary(weight, rotary.cos.shape[1], rotary.qk_norm is not None):
        return None
    row: torch.Tensor | UnnormalizedRow = x
    if isinstance(x, torch.Tensor):
        if not takes:
            return None
        row = x.reshape(1, -1).contiguous()
    return gemv(row, weight, weight_scale, bias, x_scale, rotary=rotary)


def gemv_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMV takes x times weight [N, K]: one row of K values, bf16/fp16 of
    the weight's dtype, the weight contiguous, on a device that launches dependent."""
    return (
        x.numel() == weight.shape[-1]
        and weight.dtype in _GEMV_DTYPES
        and x.dtype == weight.dtype
        and weight.is_contiguous()
        and dependent_launch(x.device)
    )


def takes_splits(layer: nn.Module, x: torch.Tensor, head_dim: int) -> int:
    """How many unmerged decode-attention splits `layer` may be handed for its input `x` (one
    row of heads of `head_dim`) as `SplitRows` (0: none): SPLITS_IN_GEMV where `forward(x)`
    runs the one-row bf16/fp16 GEMV (a `Linear`, not wrapped, e.g. by LoRA, which needs the
    merged row), or, with SPLITS_IN_PACKED_GEMV, a 4/8-bit layer's GEMV that merges them
    (`takes_split_rows`)."""
    if not (SPLITS_IN_GEMV and x.is_cuda):
        return 0
    if type(layer) is Linear:
        return SPLITS_IN_GEMV if layer.uses_triton_gemv(x) else 0
    takes = getattr(layer, "takes_split_rows", None)
    if SPLITS_IN_PACKED_GEMV and takes is not None and takes(x, head_dim):
        return SPLITS_IN_GEMV
    return 0


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [rows, H] times the LM head's weight [vocab, H]: float32 logits [rows, vocab]."""
    if lm_head_takes_gemv(hidden, weight):
        from kvfleet.engine.layers.triton_gemv import gemv

        return gemv(hidden.contiguous(), weight, out_dtype=torch.float32)
    if hidden.is_cuda and hidden.dtype != torch.float32:
        # NOTE: float32 out of the matmul itself: bf16 logits near 20 are 0.125 apart, so
        # greedy near-ties would be decided by rounding noise rather than by the model.
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return (hidden @ weight.t()).float()


def lm_head_takes_gemv(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row's logits go through the Triton GEMV (LM_HEAD_GEMV: launched dependent,
    float32 out of its float32 sums) rather than cuBLAS."""
    return LM_HEAD_GEMV and gemv_takes(hidden, weight)
