"""Tiny quantized checkpoints written as the tools people use write them (tensor names, dtypes,
shapes, config keys): llm-compressor's compressed-tensors FP8 (per-channel, per-tensor with
static input scales, 128 x 128 blocks) and the `quant_method: "fp8"` block format of DeepSeek's
and Qwen's FP8 releases. Quantized here with plain torch (not kvfleet's code), from a random
float32 Llama written by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# dims on 128-blocks (the block formats need them): q 256 | k 128 | v 128, MLP 512
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def random_llama(seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of a random float32 tiny Llama, as transformers names it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).float()
    with torch.no_grad():  # (larger than the init's 0.02, so FP8's rounding shows in logits)
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.08)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def _to_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _quantized(name: str) -> bool:
    return any(f".{p}.weight" in name for p in PROJECTIONS)


def write_compressed_tensors(
    folder: Path, state: dict[str, torch.Tensor], scheme: str, ignore: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """llm-compressor's FP8_DYNAMIC ("channel"), FP8 ("tensor": static input scales too) or
    FP8_BLOCK ("block") in the float-quantized format; returns the dequantized weights."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset = {"channel": "FP8_DYNAMIC", "tensor": "FP8", "block": "FP8_BLOCK"}[scheme]
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=["lm_head", *ignore],
        format="float-quantized",
        quantization_status="compressed",
    ).model_dump()
    tensors: dict[str, torch.Tensor] = {}
    dequantized = dict(state)
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not _quantized(name) or any(module.endswith(i) for i in ignore):
            tensors[name] = tensor
            continue
        if scheme == "block":
            values, scale = _blocks(tensor)
            dequantized[name] = _dequantize_blocks(values, scale)
        else:
            amax = tensor.abs().amax(dim=1, keepdim=True)
            scale = (amax if scheme == "channel" else amax.amax().reshape(1)) / FP8_MAX
            values = _to_fp8(tensor, scale)
            dequantized[name] = values.float() * scale
        tensors[name] = values
        tensors[f"{module}.weight_scale"] = scale.float()
        if scheme == "tensor":
            tensors[f"{module}.input_scale"] = static_input_scale(module)
    _write(folder, tensors, config)
    return dequantized


def static_input_scale(module: str) -> torch.Tensor:
    """A calibrated static input scale, as an observer would give: the same for modules that
    read the same input (q, k and v; gate and up), here drawn from the input's name."""
    shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
    shared = shared.replace("up_proj", "gate_proj")
    seed = sum(map(ord, shared))
    return (torch.rand(1, generator=torch.Generator().manual_seed(seed)) * 0.01 + 0.01).float()


def write_fp8_block(folder: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`quant_method: "fp8"` with `weight_block_size` [128, 128]: e4m3 weights and float32
    `weight_scale_inv` per block (multiplied, despite the name); returns the dequantized
    weights."""
    config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    tensors: dict[str, torch.Tensor] = {}
    dequantized = dict(state)
    for name, tensor in state.items():
        if not _quantized(name):
            tensors[name] = tensor
            continue
        values, scale = _blocks(tensor)
        tensors[name] = values
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        dequantized[name] = _dequantize_blocks(values, scale)
    _write(folder, tensors, config)
    return dequantized


def _blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    tiles = weight.reshape(rows // 128, 128, cols // 128, 128)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    values = _to_fp8(tiles, scale[:, None, :, None]).reshape(rows, cols)
    return values, scale.float()


def _dequantize_blocks(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return values.float() * full


def _write(folder: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {**TINY, "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
