"""Where SmolLM2's FP8 W8A8 perplexity rise comes from, on the CPU: the engine's float32 model
with e4m3 round trips put into its linear layers (weights once, activations at each forward,
scales as the online FP8 path takes them: `quantize_rows`), by layer kind, weights or
activations alone, and with the weight scales over other groupings (1 x 64, 1 x 32, 128 x 128
blocks) beside each grouping's weight error. The text and perplexity are bench/quality.py's.

    python3 bench/fp8_emulation.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfleet.bench.quality import TEXT, perplexity
from kvfleet.engine.layers.linear import Linear
from kvfleet.engine.layers.quantization.block_fp8 import (
    dequantize_blocks,
    quantize_blocks,
    quantize_groups,
)
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.llm import LLM

Rounding = Callable[[torch.Tensor], torch.Tensor]


def per_row(t: torch.Tensor) -> torch.Tensor:
    """t's e4m3 round trip, one scale a row (the online path's weights and activations)."""
    values, scales = quantize_rows(t.reshape(-1, t.shape[-1]))
    return (values.float() * scales).reshape(t.shape)


def per_group(group: int) -> Rounding:
    """The round trip with one scale per `group` inputs of a row (`quantize_groups`)."""

    def rounded(t: torch.Tensor) -> torch.Tensor:
        values, scales = quantize_groups(t, group)
        return values.float() * scales.repeat_interleave(group, dim=1)

    return rounded


def per_block(t: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The round trip with one scale per [block, block] tile (`quantize_blocks`, the block-FP8
    checkpoints'; the inputs padded with zeros to whole tiles)."""
    rows, cols = t.shape
    padded = torch.zeros(rows, -(-cols // block) * block)
    padded[:, :cols] = t.float()
    values, scales = quantize_blocks(padded, (block, block))
    return dequantize_blocks(values, scales, (block, block))[:, :cols]


def _rounding_inputs(forward: Rounding) -> Rounding:
    """`forward` over its input's per-row e4m3 round trip (the online path's activations)."""
    return lambda x: forward(per_row(x))


KINDS: dict[str, Callable[[str], bool]] = {
    "all": lambda name: True,
    "qkv": lambda name: name.endswith("qkv_proj"),
    "o": lambda name: name.endswith("o_proj"),
    "gate_up": lambda name: name.endswith("gate_up_proj"),
    "down": lambda name: name.endswith("down_proj"),
}


def main() -> None:
    llm = LLM("smollm2", dtype="float32", max_model_len=2048)
    engine = llm.engine
    assert engine.tokenizer is not None
    model = engine.runner.model
    ids = engine.tokenizer.encode(TEXT.read_text())
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    weights = {name: m.weight.data.clone() for name, m in layers.items()}
    forwards = {name: m.forward for name, m in layers.items()}

    def measure(chosen: Callable[[str], bool], weight: Rounding | None, acts: bool) -> float:
        for name, layer in layers.items():
            layer.weight.data.copy_(weights[name])
            layer.forward = forwards[name]  # type: ignore[method-assign]
            if not chosen(name):
                continue
            if weight is not None:
                layer.weight.data.copy_(weight(weights[name]))
            if acts:
                layer.forward = _rounding_inputs(forwards[name])  # type: ignore[method-assign, assignment]
        return perplexity(model, ids, engine.device)

    base = measure(KINDS["all"], None, False)
    print(f"{len(ids)} tokens; float32 perplexity {base:.4f}")
    ways: tuple[tuple[str, Rounding | None, bool], ...] = (
        ("W8A8", per_row, True), ("W8", per_row, False), ("A8", None, True),
    )  # fmt: skip
    for kind, chosen in KINDS.items():
        for label, rounding, acts in ways:
            rise = measure(chosen, rounding, acts) / base - 1
            print(f"{kind:8s} {label:5s} {100 * rise:+.2f}%")
    groupings: dict[str, Rounding] = {
        "per row": per_row, "1 x 64": per_group(64), "1 x 32": per_group(32),
        "128 x 128": per_block,
    }  # fmt: skip
    for label, grouping in groupings.items():
        error = sum(float((grouping(w) - w).square().sum()) for w in weights.values())
        total = sum(float(w.square().sum()) for w in weights.values())
        rise = measure(KINDS["all"], grouping, False) / base - 1
        print(f"weights {label:9s}: relative error {(error / total) ** 0.5:.3e}, "
              f"perplexity {100 * rise:+.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
