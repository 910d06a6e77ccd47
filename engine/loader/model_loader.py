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
    if quantization is not None and config.moe_layers:
        raise ValueError(
            f"quantization ({quantization.describe()}) of a mixture-of-experts model is not "
            "supported yet: its experts run in the model dtype only (serve it without "
            "--quantization)"
        )
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
        return iterate_gguf_weights(source.path, config, slice_for, packed, fused_parts(config))
    from kvfleet.engine.loader.safetensors_folder import iterate_safetensors_weights

    return iterate_safetensors_weights(source.path, slice_for, fused_parts(config))


def fused_parts(config: ModelConfig) -> Callable[[str], list[tuple[str, int, int]] | None]:
    """Phi-3 publishes q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`): the tensors each
    splits into, (name, first row, rows), so that everything after (tensor-parallel slices,
    the fused layers' loading) sees the usual names."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inner = config.intermediate_size

    def parts(name: str) -> list[tuple[str, int, int]] | None:
        if config.architecture != "phi3":
            return None
        if name.endswith(".self_attn.qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            return [
                (f"{stem}q_proj.weight", 0, q),
                (f"{stem}k_proj.weight", q, kv),
                (f"{stem}v_proj.weight", q + kv, kv),
            ]
        if name.endswith(".mlp.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            return [(f"{stem}gate_proj.weight", 0, inner), (f"{stem}up_proj.weight", inner, inner)]
        return None

    return parts


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
    yield "model.embed_tokens.weight", (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        moe = i in config.moe_layers
        yield from _input_projection_shapes(config, layer, moe)
        if config.qk_norm:
            yield f"{layer}.self_attn.q_norm.weight", (config.head_dim,)
            yield f"{layer}.self_attn.k_norm.weight", (config.head_dim,)
        yield f"{layer}.self_attn.o_proj.weight", (hidden, q)
        if config.o_bias:
            yield f"{layer}.self_attn.o_proj.bias", (hidden,)
        if not moe:
            yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        if config.mlp_bias and not moe:
            yield f"{layer}.mlp.down_proj.bias", (hidden,)
        yield f"{layer}.input_layernorm.weight", (hidden,)
        yield f"{layer}.post_attention_layernorm.weight", (hidden,)
        if config.sandwich_norms:
            yield f"{layer}.pre_feedforward_layernorm.weight", (hidden,)
            yield f"{layer}.post_feedforward_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, hidden)


def _input_projection_shapes(
    config: ModelConfig, layer: str, moe: bool
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A layer's projections of its normed inputs: q, k, v and gate, up (Phi-3's fused as it
    publishes them; a mixture of experts' router and experts in place of gate and up)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    if config.architecture == "phi3":  # (`fused_parts` splits them at load)
        yield f"{layer}.self_attn.qkv_proj.weight", (q + 2 * kv, hidden)
        yield f"{layer}.mlp.gate_up_proj.weight", (2 * inter, hidden)
        return
    parts = [
        ("self_attn.q_proj", q, config.qkv_bias),
        ("self_attn.k_proj", kv, config.qkv_bias),
        ("self_attn.v_proj", kv, config.qkv_bias),
    ]
    if not moe:
        parts += [
            ("mlp.gate_proj", inter, config.mlp_bias),
            ("mlp.up_proj", inter, config.mlp_bias),
        ]
    for name, rows, bias in parts:
        yield f"{layer}.{name}.weight", (rows, hidden)
        if bias:
            yield f"{layer}.{name}.bias", (rows,)
    if moe:
        yield from _expert_shapes(config, layer)


def _expert_shapes(config: ModelConfig, layer: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A mixture-of-experts layer's router and experts, named as the family publishes them."""
    hidden, inner = config.hidden_size, config.moe_intermediate_size
    mixtral = config.architecture == "mixtral"
    block = f"{layer}.block_sparse_moe" if mixtral else f"{layer}.mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    yield f"{block}.gate.weight", (config.num_experts, hidden)
    for expert in range(config.num_experts):
        yield f"{block}.experts.{expert}.{gate}.weight", (inner, hidden)
        yield f"{block}.experts.{expert}.{up}.weight", (inner, hidden)
        yield f"{block}.experts.{expert}.{down}.weight", (hidden, inner)


def _dummy_weights(
    model: LlamaForCausalLM,
    config: ModelConfig,
    seed: int,
    slice_for: Callable[[str], Slice | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights at real shapes (benchmarks): N(0, 0.02) matrices, unit norms (Gemma's
    (1 + w) norms: zeros), zero biases; each tensor drawn whole from its own seed in float32,
    then cut to this rank's slice and cast."""
    param = model.embed_tokens.weight  # (in the model dtype, whatever the projections hold)
    split = fused_parts(config)
    for name, shape in checkpoint_shapes(config):
        if name.endswith("norm.weight"):
            unit = torch.zeros if config.norm_offset else torch.ones
            yield name, unit(shape, dtype=param.dtype, device=param.device)
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
        parts = split(name) or [(name, 0, shape[0])]
        for part_name, first, rows in parts:
            piece = full.narrow(0, first, rows)
            yield part_name, cut(piece, slice_for(part_name)).to(param.dtype)
