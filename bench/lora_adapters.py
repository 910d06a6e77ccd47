"""Random LoRA adapters in the PEFT format for a model config: what the multi-LoRA benchmarks load.

Same files as `peft`'s `save_pretrained` writes (adapter_config.json, adapter_model.safetensors
with `base_model.model.model.layers.N.{self_attn,mlp}.X.lora_{A,B}.weight`), written directly so
the device needs no `peft`; values small and random, like a trained adapter's scale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.lora.adapter import TARGET_LAYERS, target_shapes

_PARENTS = {
    "o_proj": "self_attn",
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
}


def write_random_adapters(
    config: ModelConfig, folder: Path, count: int, rank: int, seed: int = 0
) -> dict[str, str]:
    """`count` adapters targeting every projection; returns name -> folder."""
    generator = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    made = {}
    for index in range(count):
        path = folder / f"adapter-{index}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (in_features, out_features) in shapes.items():
                parent = _PARENTS.get(module, "mlp")
                key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_features, rank, generator=generator) * 0.01
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
        from safetensors.torch import save_file

        save_file(tensors, str(path / "adapter_model.safetensors"))
        settings = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": sorted(TARGET_LAYERS),
            "bias": "none",
        }
        (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
        made[f"adapter-{index}"] = str(path)
    return made


def lora_engine_args(
    model: str, load_format: str, folder: Path, count: int, rank: int
) -> dict[str, Any]:
    """The `LLM` arguments serving `count` random rank-`rank` adapters written under `folder`
    for `model`'s shape ({} for none); their names are the keys of its `lora_modules`."""
    if not count:
        return {}
    from kvfleet.engine.loader.source import resolve_model_source

    config = resolve_model_source(model, load_format).read_config()
    return {
        "enable_lora": True,
        "max_loras": count,
        "max_lora_rank": rank,
        "lora_modules": write_random_adapters(config, folder, count, rank),
    }
