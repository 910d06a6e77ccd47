"""The projections of a model under a quantization scheme: `make_linear` builds each one (a
plain `Linear`, engine/layers/linear.py's `nn.Linear`, where nothing is quantized), and
quantized layers fill themselves from checkpoint tensors through one interface
(`QuantizedLinear.load_part`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvfleet.engine.layers.linear import Linear
from kvfleet.engine.layers.quantization.scheme import PackedScheme, QuantScheme

# (first output row, rows) of a fused layer one checkpoint tensor fills; None: all of it
Rows = tuple[int, int] | None


class QuantizedLinear(nn.Module):
    """A linear layer with quantized weights. `dtype` is its activations' (the model's)."""

    in_features: int
    out_features: int
    dtype: torch.dtype

    def checkpoint_parts(self) -> tuple[str, ...]:
        """The tensor kinds (suffixes after the module name) the checkpoint must give."""
        raise NotImplementedError

    def load_part(self, kind: str, tensor: torch.Tensor, rows: Rows, name: str) -> None:
        """Fill this layer's `rows` from the checkpoint tensor `name` of kind `kind`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Called once every checkpoint tensor has loaded (what needs all the parts)."""

    def make_bias(self, bias: bool) -> None:
        """`self.bias`: the out_features bias rows in the model dtype, or None."""
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=self.dtype), requires_grad=False)
            if bias
            else None
        )

    def load_bias_or_refuse(self, kind: str, tensor: torch.Tensor, rows: Rows, name: str) -> None:
        """The part every quantized layer reads alike: its bias rows (kept in the model
        dtype); any other tensor kind has no place in the layer."""
        bias: torch.Tensor | None = getattr(self, "bias", None)
        if kind != "bias" or bias is None:
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in a {type(self).__name__} layer"
            )
        start, count = rows if rows is not None else (0, self.out_features)
        expect_shape(name, tensor, (count,))
        bias.data.narrow(0, start, count).copy_(tensor)


def expect_shape(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> None:
    """ValueError naming the checkpoint tensor unless it has `shape` (and `dtype`)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {shape}"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, expected {dtype}")


LinearFactory = Callable[[tuple[str, ...], int, int, bool], nn.Module]


def make_linear_factory(scheme: QuantScheme | None, dtype: torch.dtype) -> LinearFactory:
    """`factory(checkpoint_modules, in_features, out_features, bias)`: the layer that holds
    those checkpoint modules (several for a fused layer: q, k and v; gate and up)."""

    def plain(
        modules: tuple[str, ...], in_features: int, out_features: int, bias: bool
    ) -> nn.Module:
        return Linear(in_features, out_features, bias=bias)

    if scheme is None:
        return plain

    def quantized(
        modules: tuple[str, ...], in_features: int, out_features: int, bias: bool
    ) -> nn.Module:
        kept = [module for module in modules if not scheme.quantizes(module)]
        if kept and len(kept) < len(modules):
            raise ValueError(
                f"the checkpoint leaves {kept} unquantized but not the rest of "
                f"{list(modules)}, which kvfleet runs as one fused layer"
            )
        if kept:
            return plain(modules, in_features, out_features, bias)
        if isinstance(scheme, PackedScheme):
            from kvfleet.engine.layers.quantization.packed import PackedLinear

            bits = scheme.bits_for(modules)
            return PackedLinear(in_features, out_features, bias, dtype, scheme, bits)
        from kvfleet.engine.layers.quantization.block_fp8 import BlockFp8Linear
        from kvfleet.engine.layers.quantization.fp8 import Fp8Linear

        if scheme.block is not None:
            # (the fp8 format calls the block scales weight_scale_inv, compressed-tensors
            # weight_scale; both are multiplied)
            scale_name = "weight_scale_inv" if scheme.source == "fp8" else "weight_scale"
            return BlockFp8Linear(
                in_features,
                out_features,
                bias,
                dtype,
                scheme.block,
                scale_name,
                online=not scheme.from_checkpoint,
            )
        return Fp8Linear(
            in_features,
            out_features,
            bias,
            dtype,
            static_input=scheme.activations == "static",
            online=not scheme.from_checkpoint,
        )

    return quantized


def linear_without_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` without its bias (a row-parallel layer adds it on one rank only)."""
    if isinstance(layer, nn.Linear):
        return nn.functional.linear(x, layer.weight)
    out: torch.Tensor = layer(x, with_bias=False)
    return out


def layer_bias(layer: nn.Module) -> torch.Tensor | None:
    bias: torch.Tensor | None = getattr(layer, "bias", None)
    return bias
