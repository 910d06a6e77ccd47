"""The mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE): a softmax router picks the
top k of E SwiGLU experts per token; their outputs are summed with the router's weights.

Experts are held stacked, as the fused kernels read them: `w13` [E, 2 * inner, hidden] (each
expert's gate rows, then its up rows) and `w2` [E, hidden, inner]. Under tensor parallelism
every rank holds every expert with a slice of its inner dimension, so the layer's output is a
partial sum, reduced like a row-parallel layer's (output identical to one rank's).

The torch references (any device) of `triton_route`'s and `triton_moe`'s kernels: `route`,
`align_rows` (the rows grouped by expert) and `experts_reference`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from kvfleet.engine.layers.linear import Linear, UnnormalizedRow
from kvfleet.engine.layers.quantization.linear import expect_shape

if TYPE_CHECKING:
    from kvfleet.engine.layers.triton_route import Choices

# One token's experts through `triton_moe_gemv` (two GEMVs; False: the grouped kernels, as
# before, for A/B runs)
ONE_TOKEN_GEMVS = True
# A checkpoint's names for each expert's three projections (Mixtral's, then the rest's)
EXPERT_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, E] logits -> (weights [num_tokens, top_k] float32, expert ids
    [num_tokens, top_k] int64): softmax over every expert in float32, the top k, rescaled to
    sum to 1 when `renormalize` (Mixtral always; Qwen3-MoE with `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Rows after padding each expert's run to BLOCK_M, at most: at most min(E, rows) experts
    are chosen, each wasting under a block."""
    worst = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_rows(
    ids: torch.Tensor,  # [num_tokens, top_k] expert ids
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted rows [max_padded] int32: row t * top_k + j of each choice, grouped by expert in
    expert order, each expert's run padded with num_rows (no row) to a multiple of block_m;
    the end of each expert's padded run [E] int32, the last one the padded total). Torch ops,
    a stable sort; no host synchronization."""
    flat = ids.flatten()
    num_rows = flat.numel()
    device = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    # each sorted row's place: its expert's padded start + its rank among that expert's rows
    starts = counts.cumsum(0) - counts
    dest = run_ends[experts] - padded[experts] + torch.arange(num_rows, device=device)
    dest -= starts[experts]
    size = max_padded_rows(num_rows, num_experts, block_m)
    sorted_rows = torch.full((size,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    return sorted_rows, run_ends.to(torch.int32)


def experts_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [E, 2 * inner, hidden]
    w2: torch.Tensor,  # [E, hidden, inner]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden]
    """Each token through its chosen experts, expert by expert (matmuls in the model dtype,
    SiLU * up and the weighted sum in float32)."""
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten()
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    for expert in torch.unique(flat_ids).tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        chosen = tokens[rows]
        gate, up = F.linear(x[chosen], w13[expert]).float().chunk(2, dim=-1)
        inner = (F.silu(gate) * up).to(x.dtype)
        expert_out = F.linear(inner, w2[expert]).float()
        out.index_add_(0, chosen, expert_out * weights.flatten()[rows, None])
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, kept in the model dtype) and stacked experts of one layer."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inner: int,
        top_k: int,
        renormalize: bool,
        fused: bool = False,
    ):
        """`inner`: this rank's share of each expert's inner dimension; `fused`: the Triton
        kernels on CUDA."""
        super().__init__()
        self.gate = Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        self.fused = fused
        # While a CUDA graph runner captures (`RealTokens.capturing`): its [1] int32 count of a
        # step's real tokens, so that its padding tokens meet no expert.
        self.real_tokens: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def takes_unnormalized(self, x: torch.Tensor) -> bool:
        """Whether this layer's input row is better left to its GEMVs to normalize
        (`UnnormalizedRow`, `torch_layers.takes_norm`): one token on the GEMV path, whose
        router runs the Triton GEMV."""
        return (
            self.fused
            and ONE_TOKEN_GEMVS
            and type(self.gate) is Linear
            and self.gate.uses_triton_gemv(x)
        )

    def forward(self, x: torch.Tensor | UnnormalizedRow) -> torch.Tensor:
        one_token = self.fused and x.shape[0] == 1 and ONE_TOKEN_GEMVS
        if isinstance(x, UnnormalizedRow) or (one_token and x.is_cuda):
            from kvfleet.engine.layers import triton_moe_gemv

            # (an `UnnormalizedRow`'s router GEMV writes x + residual)
            ranked = self._ranked(x)
            return triton_moe_gemv.one_token_moe(
                x, ranked if ranked is not None else self.gate(x), self.w13, self.w2,
                self.top_k, self.renormalize,
            )  # fmt: skip
        if self.fused and x.is_cuda:
            from kvfleet.engine.layers.triton_moe import fused_moe

            return fused_moe(
                x, self.gate(x), self.w13, self.w2, self.top_k, self.renormalize, self.real_tokens
            )
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return experts_reference(x, self.w13, self.w2, weights, ids)

    def _ranked(self, x: torch.Tensor | UnnormalizedRow) -> Choices | None:
        """The token's top k ranked by the router's one-row GEMV as it writes the logits
        (`triton_moe_gemv.RANKED_BY_ROUTER`), or None where that is off or the router's
        GEMV is not the Triton one."""
        from kvfleet.engine.layers import triton_moe_gemv
        from kvfleet.engine.layers.triton_gemv import gemv
        from kvfleet.engine.layers.triton_route import Choices

        if not triton_moe_gemv.RANKED_BY_ROUTER or type(self.gate) is not Linear:
            return None
        if not isinstance(x, UnnormalizedRow) and not self.gate.uses_triton_gemv(x):
            return None
        row = x if isinstance(x, UnnormalizedRow) else x.contiguous()
        device = row.x.device if isinstance(row, UnnormalizedRow) else row.device
        choices = Choices.empty(self.top_k, self.renormalize, device)
        gemv(row, self.gate.weight, bias=self.gate.bias, choices=choices)
        return choices

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor, name: str) -> None:
        """Fill expert `expert`'s `part` (gate, up or down) from checkpoint tensor `name`."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint tensor {name!r}: expert {expert} of a layer of {self.num_experts}"
            )
        inner = self.w2.shape[2]
        dest = {
            "gate": self.w13.data[expert, :inner],
            "up": self.w13.data[expert, inner:],
            "down": self.w2.data[expert],
        }[part]
        expect_shape(name, tensor, tuple(dest.shape))
        dest.copy_(tensor)


class RealTokens:
    """A CUDA graph runner's count of each step's real tokens ([1] int32, set before each
    replay), which its model's MoE layers read while it captures: they take only the first
    count[0] tokens of a step to experts. A bucket's padding tokens, routed on whatever an
    earlier step left in the static inputs, would stream experts no real token chose (a
    decode step of 5 in the graph of 8: up to 24 more experts a layer). Nothing to do for a
    model without MoE layers."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.count = torch.zeros(1, dtype=torch.int32, device=device)

    def set(self, num_tokens: int) -> None:
        """Before a replay: this step's real tokens (the rest of the bucket is padding)."""
        if self.blocks:
            self.count.fill_(num_tokens)

    @contextmanager
    def capturing(self, num_tokens: int) -> Iterator[None]:
        """Around a graph's warm-up and capture (all `num_tokens` of the bucket real then)."""
        self.set(num_tokens)
        for block in self.blocks:
            block.real_tokens = self.count
        try:
            yield
        finally:
            for block in self.blocks:
                block.real_tokens = None
