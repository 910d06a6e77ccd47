"""LoRA adapters in the PEFT format: read, check against the base model, scale.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, target modules) and
`adapter_model.safetensors` (or the older `adapter_model.bin`) with one `lora_A` [r, in] and one
`lora_B` [out, r] per adapted projection. Every problem is a `LoRAError` naming the reason, so
the server can answer 400 and keep serving.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.config import ModelConfig

# The projections an adapter may target, and which fused base layer each one lives in.
TARGET_LAYERS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
# Phi-3's fused projections: an adapter on one is an adapter on each part (one A, B cut by rows)
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# PEFT names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served here; the message says why (HTTP 400)."""


class LoRANotFoundError(LoRAError):
    """A name no loaded adapter has (HTTP 404)."""


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer index, target module) -> (A [rank, in], B [out, rank] times `scaling`), float32 CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (in_features, out_features) in the base model."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the base model `config`."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: {str(folder)!r} is not a folder")
    settings = _read_config(name, folder)
    rank = int(settings.get("r", 0))
    if rank < 1:
        raise LoRAError(f"adapter {name!r}: rank r={rank} in adapter_config.json")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank}, above this engine's max_lora_rank {max_rank}"
        )
    alpha = float(settings.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pairs = _pairs(name, _read_tensors(name, folder), config)
    if not pairs:
        raise LoRAError(f"adapter {name!r}: no LoRA weights in {str(folder)!r}")
    shapes = target_shapes(config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = halves["A"].float(), halves["B"].float()
        parts = FUSED_TARGETS.get(module, (module,))
        in_features = shapes[parts[0]][0]
        out_features = sum(shapes[part][1] for part in parts)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; the base model needs ({rank}, {in_features}) and "
                f"({out_features}, {rank}) — was it trained for another model?"
            )
        rows = torch.split(b, [shapes[part][1] for part in parts])
        for part, part_b in zip(parts, rows, strict=True):
            if (layer, part) in weights:
                raise LoRAError(f"adapter {name!r}: layer {layer} adapts {part} twice")
            weights[(layer, part)] = (a.contiguous(), (part_b * scaling).contiguous())
    return LoRAAdapter(name, str(folder), rank, scaling, weights)


_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _pairs(
    name: str, tensors: dict[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, target module) -> {"A": lora_A, "B": lora_B}, each key checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"adapter {name!r}: unsupported weight {key!r}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in TARGET_LAYERS and module not in FUSED_TARGETS:
            raise LoRAError(
                f"adapter {name!r}: unsupported target module {module!r}; supported: "
                f"{', '.join([*TARGET_LAYERS, *FUSED_TARGETS])}"
            )
        if not 0 <= layer < config.num_hidden_layers:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} does not exist in the base model "
                f"({config.num_hidden_layers} layers)"
            )
        if layer in config.moe_layers and module in _MLP_TARGETS:
            raise LoRAError(
                f"adapter {name!r}: layer {layer} is a mixture of experts; LoRA on its experts "
                "is not supported (adapters may target q_proj, k_proj, v_proj, o_proj there)"
            )
        pairs.setdefault((layer, module), {})[half] = tensor
    return pairs


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise LoRAError(f"adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        settings = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: adapter_config.json is unreadable: {exc}") from exc
    if not isinstance(settings, dict):
        raise LoRAError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    unsupported = {
        "peft_type": peft_type != "LORA",
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
        "bias": settings.get("bias", "none") != "none",
        "modules_to_save": bool(settings.get("modules_to_save")),
        "use_dora": bool(settings.get("use_dora")),
        "rank_pattern": bool(settings.get("rank_pattern")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
    }
    for field_name, bad in unsupported.items():
        if bad:
            raise LoRAError(
                f"adapter {name!r}: {field_name}={settings.get(field_name)!r} is not supported "
                "(plain LoRA on the attention and MLP projections only)"
            )
    return settings


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_path = folder / "adapter_model.safetensors"
    bin_path = folder / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return dict(load_file(str(safetensors_path)))
        if bin_path.is_file():
            loaded = torch.load(bin_path, map_location="cpu", weights_only=True)
            if isinstance(loaded, dict):
                return {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    except Exception as exc:  # a damaged file: any reader error is the adapter's fault
        raise LoRAError(f"adapter {name!r}: cannot read the adapter weights: {exc}") from exc
    raise LoRAError(
        f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {str(folder)!r}"
    )
