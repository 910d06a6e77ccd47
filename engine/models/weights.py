"""Hugging Face checkpoint tensors into a `LlamaForCausalLM`'s parameters: names mapped to the
fused projections (q/k/v, gate/up), the stacked experts and the FP8 KV scales; quantized layers
fill themselves; every parameter must be set."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.layers.moe import EXPERT_PARTS, SparseMoeBlock
from kvfleet.engine.layers.quantization.linear import QuantizedLinear, expect_shape
from kvfleet.engine.models.llama import LlamaAttention, LlamaForCausalLM


def load_hf_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into the (fused) parameters, quantized layers
    filling themselves; every one must be set."""
    params = dict(model.named_parameters())
    for module in model.modules():  # (buffers come uninitialized from the meta device)
        if isinstance(module, LlamaAttention):
            module.kv_scales.fill_(1.0)
    quantized = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            loaded.add(_load_expert(model, expert, tensor, hf_name))
            continue
        target = _map_hf_name(hf_name, model.config)
        if target is None:
            continue
        name, shard = target
        owner, _, kind = name.rpartition(".")
        if kind in ("k_scale", "v_scale"):  # (an FP8 KV cache's, per layer)
            _load_kv_scale(model, owner, kind, tensor, hf_name)
            continue
        if owner in quantized:
            quantized[owner].load_part(kind, tensor, shard, hf_name)
            loaded.add(f"{name}:{shard}")
            continue
        param = _plain_target(params, name, tensor, hf_name)
        dest = param.data if shard is None else param.data.narrow(0, *shard)
        if model.tp is not None and name in ("embed_tokens.weight", "lm_head.weight"):
            dest[tensor.shape[0] :].zero_()  # the padding rows of the last vocabulary shard
            dest = dest[: tensor.shape[0]]
        expect_shape(hf_name, tensor, tuple(dest.shape))
        dest.copy_(tensor)
        loaded.add(f"{name}:{shard}")
    missing = sorted(set(_expected_parts(model, params, quantized)) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for layer in quantized.values():
        layer.finish_loading()


def _load_expert(
    model: LlamaForCausalLM, match: re.Match[str], tensor: torch.Tensor, hf_name: str
) -> str:
    index, expert, part = int(match[1]), int(match[2]), EXPERT_PARTS[match[3]]
    moe = model.layers[index].mlp if index < len(model.layers) else None
    if not isinstance(moe, SparseMoeBlock):
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
    moe.load_expert(expert, part, tensor, hf_name)
    return f"layers.{index}.mlp.experts:{expert}:{part}"


def _load_kv_scale(
    model: LlamaForCausalLM, owner: str, kind: str, tensor: torch.Tensor, hf_name: str
) -> None:
    value = float(tensor.reshape(())) if tensor.numel() == 1 else float("nan")
    if not 0.0 < value < float("inf"):
        raise ValueError(f"checkpoint tensor {hf_name!r} is no positive scale")
    try:
        attention = model.get_submodule(owner)
    except AttributeError:
        attention = None
    if not isinstance(attention, LlamaAttention):
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
    attention.kv_scales[int(kind == "v_scale")] = value
    attention.kv_scales_given = True


def _plain_target(
    params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, hf_name: str
) -> nn.Parameter:
    """The parameter of a layer kept in the model dtype that `hf_name` fills."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
    if tensor.dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is quantized ({tensor.dtype}); kvfleet reads "
            "quantized weights for the attention and MLP projections only (the embeddings, "
            "norms and LM head stay in the model dtype)"
        )
    return params[name]


# One expert's projection: model.layers.3.mlp.experts.7.gate_proj.weight (Qwen3-MoE),
# model.layers.3.block_sparse_moe.experts.7.w1.weight (Mixtral)
_EXPERT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)"
    r"\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)

_SHARDED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _map_hf_name(hf_name: str, config: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """A Hugging Face tensor name -> (our parameter, (row offset, rows) or None); None to skip."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    for hf_part, (ours, index) in _SHARDED.items():
        marker = f".{hf_part}."
        if marker in name:
            return name.replace(marker, f".{ours}."), _shard_rows(ours, index, config)
    return name, None


def _shard_rows(fused: str, index: int, config: ModelConfig) -> tuple[int, int]:
    if fused == "gate_up_proj":
        return index * config.intermediate_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    offsets = (0, q_size, q_size + kv_size)
    return offsets[index], (q_size, kv_size, kv_size)[index]


def _expected_parts(
    model: LlamaForCausalLM,
    params: dict[str, nn.Parameter],
    quantized: dict[str, QuantizedLinear],
) -> Iterable[str]:
    """What `load_weights` must have set: `name:rows` of each parameter part and quantized
    tensor kind, `layers.N.mlp.experts:expert:part` of each expert."""
    experts = {
        name: module for name, module in model.named_modules() if isinstance(module, SparseMoeBlock)
    }
    for owner, moe in experts.items():
        for expert in range(moe.num_experts):
            for part in ("gate", "up", "down"):
                yield f"{owner}.experts:{expert}:{part}"
    names = [
        name
        for name in params
        if name.rpartition(".")[0] not in quantized
        and not (name.rpartition(".")[0] in experts and name.endswith((".w13", ".w2")))
    ]
    names += [f"{owner}.{kind}" for owner, q in quantized.items() for kind in q.checkpoint_parts()]
    for name in names:
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            yield f"{name}:None"
        else:
            for index in range(3 if fused == "qkv_proj" else 2):
                yield f"{name}:{_shard_rows(fused, index, model.config)}"
