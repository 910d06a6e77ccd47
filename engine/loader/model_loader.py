"""load_model: build a model on its device in its dtype, then fill its weights.

With tensor parallelism each rank keeps only its slices: safetensors are read slice by slice;
GGUF row slices are cut before dequantizing (column slices after); random (dummy) weights are
drawn per checkpoint tensor from a seed of its own, so every tensor-parallel size sees the same
model.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.layers.quantization.linear import make_linear_factory
from kvfleet.engine.layers.quantization.scheme import Fp8Scheme, PackedScheme, QuantScheme
from kvfleet.engine.loader.source import ModelSource
from kvfleet.engine.models.llama import AttentionFactory, LlamaForCausalLM
from kvfleet.engine.parallel.partition import Slice

if TYPE_CHECKING:
    from kvfleet.engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionFactory,
    seed: int = 0,
    fused: bool = False,
    tp: TPGroup | None = None,
    quantization: QuantScheme | None = None,
) -> LlamaForCausalLM:
    """`config` is the whole model's; with `tp`, this rank's part of it is built and filled.
    `quantization`: the projections' (their weights quantized at load, or read quantized)."""
    default_dtype = torch.get_default_dtype()
    linear = make_linear_factory(quantization, dtype)
    try:
        torch.set_default_dtype(dtype)  # parameters are born in the model's dtype
        with torch.device("meta"):
            model = LlamaForCausalLM(config, attention, fused, tp, linear)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    block = quantization.block if isinstance(quantization, Fp8Scheme) else None
    packed = (
        (quantization.source, quantization.group_size, quantization.bits)
        if isinstance(quantization, PackedScheme) and quantization.source in ("awq", "gptq")
        else None
    )
    slice_for = (
        _whole if tp is None else functools.partial(tp.plan.slice_for, block=block, packed=packed)
    )
    if source.format == "dummy":
        weights = _dummy_weights(model, config, seed, slice_for)
    else:
        weights = _weights(source, config, slice_for, quantization)
    with torch.no_grad():
        model.load_weights(_with_progress(weights, f"loading {source.name}"))
    return model.eval()


def _whole(hf_name: str) -> Slice | None:
    return None


def cut(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    """The part of a checkpoint tensor a rank keeps (all of it for None)."""
    if part is None:
        return tensor
    dim, start, length = part
    return tensor.narrow(dim, start, length)


def _weights(
    source: ModelSource,
    config: ModelConfig,
    slice_for: Callable[[str], Slice | None],
    quantization: QuantScheme | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    if source.format == "gguf":
        from kvfleet.engine.loader.gguf import iterate_gguf_weights

        # (only quantization='gguf' reads Q4 blocks as they are; 'rtn' rounds the dequantized
        # weights like any other checkpoint's)
        packed = (
            quantization
            if isinstance(quantization, PackedScheme) and quantization.source == "gguf"
            else None
        )
        return iterate_gguf_weights(source.path, config, slice_for, packed)
    from kvfleet.engine.loader.safetensors_folder import iterate_safetensors_weights

    return iterate_safetensors_weights(source.path, slice_for)


def _with_progress(
    weights: Iterable[tuple[str, torch.Tensor]], label: str
) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(desc=label, unit=" tensors", leave=False) as bar:
        for item in weights:
            yield item
            bar.update()


def checkpoint_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    yield "model.embed_tokens.weight", (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for name, rows, bias in (
            ("self_attn.q_proj", q, config.qkv_bias),
            ("self_attn.k_proj", kv, config.qkv_bias),
            ("self_attn.v_proj", kv, config.qkv_bias),
            ("mlp.gate_proj", inter, config.mlp_bias),
            ("mlp.up_proj", inter, config.mlp_bias),
        ):
            yield f"{layer}.{name}.weight", (rows, hidden)
            if bias:
                yield f"{layer}.{name}.bias", (rows,)
        if config.qk_norm:
            yield f"{layer}.self_attn.q_norm.weight", (config.head_dim,)
            yield f"{layer}.self_attn.k_norm.weight", (config.head_dim,)
        yield f"{layer}.self_attn.o_proj.weight", (hidden, q)
        if config.o_bias:
            yield f"{layer}.self_attn.o_proj.bias", (hidden,)
        yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        if config.mlp_bias:
            yield f"{layer}.mlp.down_proj.bias", (hidden,)
        yield f"{layer}.input_layernorm.weight", (hidden,)
        yield f"{layer}.post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, hidden)


def _dummy_weights(
    model: LlamaForCausalLM,
    config: ModelConfig,
    seed: int,
    slice_for: Callable[[str], Slice | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights at real shapes (benchmarks): N(0, 0.02) matrices, unit norms, zero
    biases; each tensor drawn whole from its own seed in float32, then cut to this rank's slice
    and cast."""
    param = model.embed_tokens.weight  # (in the model dtype, whatever the projections hold)
    for name, shape in checkpoint_shapes(config):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=param.dtype, device=param.device)
            continue
        if name.endswith(".bias"):
            yield (
                name,
                cut(torch.zeros(shape, dtype=param.dtype, device=param.device), slice_for(name)),
            )
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        # NOTE: drawn in float32 whatever the dtype, so a bfloat16 model holds the float32
        # model's weights rounded (the two can be compared).
        full = torch.empty(shape, dtype=torch.float32, device=param.device)
        full.normal_(0.0, 0.02, generator=generator)
        yield name, cut(full, slice_for(name)).to(param.dtype)
