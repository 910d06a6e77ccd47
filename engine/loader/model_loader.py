"""load_model: build a model on its device in its dtype, then fill its weights."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from tqdm import tqdm

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.loader.source import ModelSource
from kvfleet.engine.models.llama import AttentionFactory, LlamaForCausalLM

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionFactory,
    seed: int = 0,
    fused: bool = False,
) -> LlamaForCausalLM:
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)  # parameters are born in the model's dtype
        with torch.device("meta"):
            model = LlamaForCausalLM(config, attention, fused)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    if source.format == "dummy":
        _init_dummy_weights(model, seed)
    else:
        model.load_weights(_with_progress(_weights(source, config), f"loading {source.name}"))
    return model.eval()


def _weights(source: ModelSource, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if source.format == "gguf":
        from kvfleet.engine.loader.gguf import iterate_gguf_weights

        return iterate_gguf_weights(source.path, config)
    from kvfleet.engine.loader.safetensors_folder import iterate_safetensors_weights

    return iterate_safetensors_weights(source.path)


def _with_progress(
    weights: Iterable[tuple[str, torch.Tensor]], label: str
) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(desc=label, unit=" tensors", leave=False) as bar:
        for item in weights:
            yield item
            bar.update()


@torch.no_grad()
def _init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights at real shapes (benchmarks): N(0, 0.02) matrices, unit norms, zero biases."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
