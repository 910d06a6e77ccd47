"""LoRA-capable projections: a base linear layer plus every resident adapter's weights in slots.

`attach_lora` wraps the attention and MLP projections of a loaded model in place; the wrappers
share one `LoRAContext`, which the runner points at the step's `LoRABatch` (or None: the base
layer alone runs, at no extra cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvfleet.engine.layers.quantization.linear import QuantizedLinear
from kvfleet.engine.lora.adapter import TARGET_LAYERS, LoRAAdapter, target_shapes
from kvfleet.engine.lora.ops import LoRABatch, add_lora_reference
from kvfleet.engine.models.llama import LlamaForCausalLM


@dataclass
class LoRAContext:
    """Shared by every LoRALinear of a model: the step's token grouping, if any."""

    batch: LoRABatch | None = None
    use_triton: bool = False
    # On a GPU the shrink runs on a side stream beside the base layer's matmul (both only read
    # the input); the expand, which adds into the matmul's output, waits for both.
    overlap_shrink: bool = True
    _side_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict, init=False)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream the shrinks run on for `device`; None where they run in line."""
        if device.type != "cuda" or not self.overlap_shrink:
            return None
        index = torch.cuda.current_device() if device.index is None else device.index
        if index not in self._side_streams:
            self._side_streams[index] = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
        return self._side_streams[index]


class LoRALinear(nn.Module):
    lora_a: torch.Tensor  # [max_loras, num_slices * max_rank, in_features]
    lora_b: torch.Tensor  # [max_loras, out_features, max_rank]
    slice_starts: torch.Tensor  # [num_slices + 1] int32: slice_bounds on the device

    def __init__(
        self,
        base: nn.Linear | QuantizedLinear,
        layer_index: int,
        targets: tuple[str, ...],
        out_sizes: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        context: LoRAContext,
    ) -> None:
        super().__init__()
        self.base = base
        self.layer_index = layer_index
        self.targets = targets
        self.context = context
        self.max_rank = max_rank
        bounds = [0]
        for size in out_sizes:
            bounds.append(bounds[-1] + size)
        assert bounds[-1] == base.out_features
        self.slice_bounds = tuple(bounds)
        # (a quantized base layer's weights are not in the activations' dtype, its `dtype` is;
        # an INT4 one has no `weight` at all)
        dtype = base.dtype if isinstance(base, QuantizedLinear) else base.weight.dtype
        device = next(base.parameters()).device
        self.register_buffer(
            "slice_starts",
            torch.tensor(bounds, dtype=torch.int32, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_a",
            torch.zeros(
                max_loras,
                len(targets) * max_rank,
                base.in_features,
                dtype=dtype,
                device=device,
            ),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, base.out_features, max_rank, dtype=dtype, device=device),
            persistent=False,
        )

    def set_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter`'s weights for this layer into `slot` (zeros where it has none)."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        r = self.max_rank
        for s, target in enumerate(self.targets):
            pair = adapter.weights.get((self.layer_index, target))
            if pair is None:
                continue
            a_t, b_t = pair
            rank = a_t.shape[0]
            lo, hi = self.slice_bounds[s], self.slice_bounds[s + 1]
            a[s * r : s * r + rank].copy_(a_t, non_blocking=True)
            b[lo:hi, :rank].copy_(b_t, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None:
            return self.base(x)  # type: ignore[no-any-return]
        if not self.context.use_triton:
            out: torch.Tensor = self.base(x)
            add_lora_reference(out, x, self.lora_a, self.lora_b, batch, self.slice_bounds)
            return out
        from kvfleet.engine.lora import triton_ops

        partial = triton_ops.new_partial(x, self.lora_a)
        side = self.context.side_stream(x.device)
        if side is None:
            triton_ops.shrink(partial, x, self.lora_a, batch)
            out = self.base(x)
        else:
            # (x and partial belong to the main stream, which frees them only after the join;
            # captured in a CUDA graph, the fork and the join become the graph's edges)
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                triton_ops.shrink(partial, x, self.lora_a, batch)
            out = self.base(x)
            main.wait_stream(side)
        triton_ops.expand(out, partial, self.lora_b, batch, self.slice_bounds, self.slice_starts)
        return out


def wrapped_layers() -> dict[str, tuple[str, ...]]:
    """Each fused base layer and the adapter target modules it holds, in output order."""
    layers: dict[str, tuple[str, ...]] = {}
    for target, layer in TARGET_LAYERS.items():
        layers[layer] = (*layers.get(layer, ()), target)
    return layers


def attach_lora(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, context: LoRAContext
) -> list[LoRALinear]:
    """Wrap every layer's projections in place; returns the wrappers."""
    shapes = target_shapes(model.config)
    fused = wrapped_layers()
    wrappers = []
    for index, layer in enumerate(model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, targets in fused.items():
                base = getattr(parent, name, None)
                if not isinstance(base, nn.Linear | QuantizedLinear):
                    continue
                out_sizes = tuple(shapes[t][1] for t in targets)
                wrapper = LoRALinear(base, index, targets, out_sizes, max_loras, max_rank, context)
                setattr(parent, name, wrapper)
                wrappers.append(wrapper)
    return wrappers
