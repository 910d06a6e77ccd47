"""GGUF files: the model config from metadata, and weights to Hugging Face names: dequantized,
or for Q4_0 / Q4_1 projections on a GPU kept 4-bit (repacked into kvfleet's INT4 layout,
engine/layers/quantization/int4.py), so a GGUF model keeps its memory there.

llama.cpp's converter permutes the rows of Q and K projections of llama-architecture models
(interleaved rotary pairs); reading them back undoes that permutation.

Q4_0 and Q4_1 blocks hold 32 weights of one row: a float16 scale d (Q4_1: then a float16 min
m) and 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31; w = d (q - 8)
(Q4_0), w = d q + m (Q4_1). Both are a scale and a zero point per group of 32 inputs: zero 8,
or zero -m / d.
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
from kvfleet.engine.layers.quantization.int4 import pack_rows
from kvfleet.engine.layers.quantization.scheme import Int4Scheme

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
REPACKED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
GGUF_GROUP_SIZE = 32
# (projections run as one fused layer: repacked all together or not at all)
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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


def gguf_int4_scheme(path: Path) -> Int4Scheme | None:
    """The INT4 scheme that keeps the file's Q4_0 / Q4_1 projections 4-bit (the others, and a
    fused layer with any part of another type, are dequantized); None without any."""
    types = {}
    for tensor in _open(path).tensors:
        name = gguf_to_hf_name(tensor.name)
        if name.endswith("_proj.weight"):
            types[name.removesuffix(".weight")] = tensor.tensor_type
    kept = {module for module, kind in types.items() if kind in REPACKED_TYPES}
    for module in list(kept):
        owner, _, proj = module.rpartition(".")
        siblings = next((group for group in _FUSED if proj in group), (proj,))
        if any(f"{owner}.{sibling}" not in kept for sibling in siblings):
            kept.discard(module)
    if not kept:
        return None
    ignore = tuple(sorted(module for module in types if module not in kept))
    return Int4Scheme(source="gguf", group_size=GGUF_GROUP_SIZE, ignore=ignore)


def config_inputs(tensor: Any) -> int:
    """A GGUF weight's inputs (its row length; gguf lists the shape innermost first)."""
    return int(tensor.shape[0])


def q4_to_int4(data: np.ndarray, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 rows (uint8 [N, K / 32 x block bytes]) -> (qweight int32 [K / 8, N], scales
    [K / 32, N], zeros [K / 32, N]; float32) in kvfleet's INT4 layout."""
    q4_1 = kind == GGMLQuantizationType.Q4_1
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 20 if q4_1 else 18)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:] if q4_1 else blocks[..., 2:]
    values = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.int32)  # [N, G, 32]
    if q4_1:  # w = d q + m = (q - zero) d with zero = -m / d
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        flat = scales == 0  # (a constant block: 1 x (0 + m))
        zeros = np.where(flat, -mins, -mins / np.where(flat, 1.0, scales))
        scales = np.where(flat, 1.0, scales)
        values = np.where(flat[..., None], 0, values)
    else:
        zeros = np.full_like(scales, 8.0)
    weights = torch.from_numpy(values.reshape(rows, -1)).t()
    return (
        pack_rows(weights),
        torch.from_numpy(np.ascontiguousarray(scales.T)),
        torch.from_numpy(np.ascontiguousarray(zeros.T, dtype=np.float32)),
    )


def iterate_gguf_weights(
    path: Path,
    config: ModelConfig,
    slice_for: Callable[[str], tuple[int, int, int] | None] | None = None,
    int4: Int4Scheme | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized, but for
    the projections `int4` (`gguf_int4_scheme`) keeps 4-bit: their `qweight`, `scales` and
    `zeros`. With `slice_for` (tensor parallelism) only that (dim, start, length) slice is
    returned: row slices are cut from the quantized rows before dequantizing; column slices
    after."""
    reader = _open(path)
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        part = slice_for(hf_name) if slice_for is not None else None
        data = tensor.data
        if part is not None and part[0] == 0:  # whole rows (and whole heads): quantized as is
            data = data[part[1] : part[1] + part[2]]
        module = hf_name.removesuffix(".weight")
        if int4 is not None and hf_name.endswith("_proj.weight") and int4.quantizes(module):
            if part is not None and part[0] == 1:  # (whole blocks of 32 inputs)
                block_bytes = data.shape[1] * GGUF_GROUP_SIZE // config_inputs(tensor)
                if part[1] % GGUF_GROUP_SIZE or part[2] % GGUF_GROUP_SIZE:
                    raise ValueError(
                        f"{hf_name}: this rank's inputs {part[1]}..{part[1] + part[2]} do not "
                        f"fall on the file's blocks of {GGUF_GROUP_SIZE}; choose a tensor "
                        "parallel size that splits the layers on them"
                    )
                first, count = part[1] // GGUF_GROUP_SIZE, part[2] // GGUF_GROUP_SIZE
                data = data[:, first * block_bytes : (first + count) * block_bytes]
            if config.architecture == "llama" and hf_name.endswith(
                ("q_proj.weight", "k_proj.weight")
            ):
                data = reverse_permute_qk(data, data.shape[0] // config.head_dim)
            qweight, scales, zeros = q4_to_int4(data, tensor.tensor_type)
            yield f"{module}.qweight", qweight
            yield f"{module}.scales", scales
            yield f"{module}.zeros", zeros
            continue
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
