"""GGUF files: the model config from metadata, and weights dequantized to Hugging Face names.

llama.cpp's converter permutes the rows of Q and K projections of llama-architecture models
(interleaved rotary pairs); reading them back undoes that permutation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvfleet.engine.config import ModelConfig

# Types kvfleet has tested end to end; others the gguf package can dequantize are accepted too.
TESTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        fields[name] = field.contents()
    return fields


def read_gguf_config(path: Path) -> ModelConfig:
    reader = _open(path)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: GGUF files with rope_freqs (Llama 3.1 style rope scaling) are not supported "
            "yet; load the Hugging Face folder of the model instead"
        )
    return ModelConfig.from_gguf_fields(read_fields(reader), "output.weight" in names)


def iterate_gguf_weights(
    path: Path,
    config: ModelConfig,
    slice_for: Callable[[str], tuple[int, int, int] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized. With
    `slice_for` (tensor parallelism) only that (dim, start, length) slice is returned: row slices
    are cut from the quantized rows before dequantizing; column slices after."""
    reader = _open(path)
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        part = slice_for(hf_name) if slice_for is not None else None
        data = tensor.data
        if part is not None and part[0] == 0:  # whole rows (and whole heads): quantized as is
            data = data[part[1] : part[1] + part[2]]
        try:
            array = dequantize(data, tensor.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            tested = ", ".join(TESTED_TYPES)
            raise ValueError(
                f"{path}: tensor {tensor.name} has type {kind}, which kvfleet cannot dequantize "
                f"(tested: {tested})"
            ) from None
        # NOTE: a copy: the reader memory-maps the file read-only.
        array = np.array(array, dtype=np.float32, copy=True)
        if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = array.shape[0] // config.head_dim  # (a row slice holds whole heads)
            array = reverse_permute_qk(array, heads)
        if part is not None and part[0] == 1:
            array = array[:, part[1] : part[1] + part[2]]
        yield hf_name, torch.from_numpy(np.ascontiguousarray(array))


def gguf_to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {name!r} for a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def reverse_permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: rows (head, pair, half) back to (head, half, pair)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc
