"""GGUF files: the model config from metadata, and weights to Hugging Face names: dequantized,
or with quantization='gguf' the Q4_0 / Q4_1 / Q4_K projections kept 4-bit and the Q8_0 ones
8-bit (repacked into kvfleet's packed-integer layout, engine/layers/quantization/packed.py), so
a GGUF model keeps its memory on the GPU.

llama.cpp's converter permutes the rows of Q and K projections of llama-architecture models
(interleaved rotary pairs); reading them back undoes that permutation.

Q4_0 and Q4_1 blocks hold 32 weights of one row: a float16 scale d (Q4_1: then a float16 min
m) and 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31; w = d (q - 8)
(Q4_0), w = d q + m (Q4_1). Q4_K super-blocks hold 256: float16 d and dmin, eight 6-bit
scales and mins packed in 12 bytes, then 4 x 32 bytes whose low nibbles are one group of 32
and high nibbles the next; w = d sc q - dmin m. All are a scale and a zero point per group of
32 inputs: zero 8, -m / d, or dmin m / (d sc). Q8_0 blocks hold 32 weights: a float16 scale
d and 32 signed bytes, w = d q: stored as q + 128 with zero 128.
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
from kvfleet.engine.config.gguf_metadata import model_config_from_gguf
from kvfleet.engine.layers.quantization.packed import pack_rows
from kvfleet.engine.layers.quantization.scheme import PackedScheme
from kvfleet.engine.loader.safetensors_folder import FusedParts

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # (a mixture of experts' router)
}
# Gemma's norms around the attention and the MLP (llama.cpp's ffn_norm is Llama's norm after
# the attention, Gemma's before the MLP); Phi-3's fused projections, as it publishes them
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Phi-3's LongRoPE factors: read into the config (`read_gguf_config`), no parameter
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long", "rope_factors_short.weight": "short"}
# A mixture of experts' projections: all experts in one tensor [E, rows, inputs], or (files
# converted before mid-2024) one tensor per expert
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_LEGACY_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Architectures whose Q and K rows llama.cpp's converter permuted
_PERMUTED = ("llama", "mixtral")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
REPACKED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K,
                  GGMLQuantizationType.Q8_0)  # fmt: skip
GGUF_GROUP_SIZE = 32
_BLOCK_INPUTS = {GGMLQuantizationType.Q4_0: 32, GGMLQuantizationType.Q4_1: 32,
                 GGMLQuantizationType.Q4_K: 256, GGMLQuantizationType.Q8_0: 32}  # fmt: skip
# The projections that run as one fused layer (repacked all together or not at all, in 8-bit
# words when any part is Q8_0), by that layer's name (Phi-3's files hold them fused)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
    rope_factors = {
        ROPE_FACTOR_TENSORS[t.name]: _dequantized(path, t, t.data).reshape(-1).tolist()
        for t in reader.tensors
        if t.name in ROPE_FACTOR_TENSORS
    }
    return model_config_from_gguf(read_fields(reader), "output.weight" in names, rope_factors)


def gguf_packed_scheme(path: Path) -> PackedScheme | None:
    """The scheme that keeps the file's Q4_0 / Q4_1 / Q4_K projections 4-bit and its Q8_0 ones
    8-bit (the others, and a fused layer with any part of another type, are dequantized); None
    without any."""
    reader = _open(path)
    arch = str(read_fields(reader)["general.architecture"])
    types = {}
    for tensor in reader.tensors:
        if _EXPERT_TENSOR.fullmatch(tensor.name):
            continue  # (quantized experts are refused when the model loads)
        name = gguf_to_hf_name(tensor.name, arch)
        if name is None or not name.endswith("_proj.weight"):
            continue
        for module in _unfused_modules(name.removesuffix(".weight")):
            types[module] = tensor.tensor_type
    kept = {module for module, kind in types.items() if kind in REPACKED_TYPES}
    for module in list(kept):
        owner, _, proj = module.rpartition(".")
        siblings = next((group for group in _FUSED.values() if proj in group), (proj,))
        if any(f"{owner}.{sibling}" not in kept for sibling in siblings):
            kept.discard(module)
    if not kept:
        return None
    ignore = tuple(sorted(module for module in types if module not in kept))
    eight_bit = set()
    for module in kept:
        owner, _, proj = module.rpartition(".")
        siblings = next((group for group in _FUSED.values() if proj in group), (proj,))
        if any(types[f"{owner}.{sibling}"] == GGMLQuantizationType.Q8_0 for sibling in siblings):
            eight_bit.add(module)
    return PackedScheme(
        source="gguf",
        group_size=GGUF_GROUP_SIZE,
        ignore=ignore,
        eight_bit=tuple(sorted(eight_bit)),
    )


def config_inputs(tensor: Any) -> int:
    """A GGUF weight's inputs (its row length; gguf lists the shape innermost first)."""
    return int(tensor.shape[0])


def gguf_to_packed(
    data: np.ndarray, kind: int, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K / Q8_0 rows (uint8 [N, blocks x block bytes]) -> (qweight int32
    [K / (32 / bits), N], scales [K / 32, N], zeros [K / 32, N]; float32) in kvfleet's layout of
    `bits`-bit values (a Q8_0 layer needs 8; a Q4 one takes either)."""
    rows = data.shape[0]
    data = np.ascontiguousarray(data)
    if kind == GGMLQuantizationType.Q8_0:
        if bits != 8:
            raise ValueError("Q8_0 blocks need 8-bit words")
        blocks = data.reshape(rows, -1, 34)
        scales = _halves(blocks[..., 0:2])
        values = blocks[..., 2:].view(np.int8).astype(np.int32) + 128  # [N, G, 32]
        offsets = -128.0 * scales
    elif kind == GGMLQuantizationType.Q4_K:
        values, scales, offsets = _q4_k_groups(data.reshape(rows, -1, 144))
    else:
        q4_1 = kind == GGMLQuantizationType.Q4_1
        blocks = data.reshape(rows, -1, 20 if q4_1 else 18)
        scales = _halves(blocks[..., 0:2])
        packed = blocks[..., 4:] if q4_1 else blocks[..., 2:]
        values = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [N, G, 32]
        # (w = s q + offset: Q4_0's offset -8 s, Q4_1's the min m)
        offsets = _halves(blocks[..., 2:4]) if q4_1 else -8.0 * scales
    # w = s q + offset = (q - zero) s with zero = -offset / s; a constant block (s = 0) as
    # 1 x (0 - zero)
    flat = scales == 0
    zeros = np.where(flat, -offsets, -offsets / np.where(flat, 1.0, scales))
    scales = np.where(flat, 1.0, scales)
    values = np.where(flat[..., None], 0, values).astype(np.int32)
    weights = torch.from_numpy(values.reshape(rows, -1)).t()
    return (
        pack_rows(weights, bits),
        torch.from_numpy(np.ascontiguousarray(scales.T, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zeros.T, dtype=np.float32)),
    )


def _halves(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes of float16 -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [N, S, 144] -> (values [N, 8 S, 32], scales and offsets [N, 8 S]):
    group g of super-block s is sub-block g % 8, w = (d sc) q - (dmin m)."""
    rows, supers = blocks.shape[:2]
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    packed_scales = blocks[..., 4:16].reshape(rows, supers, 3, 4)
    low, high, mixed = packed_scales[..., 0, :], packed_scales[..., 1, :], packed_scales[..., 2, :]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 1, 2, 1
    )
    values = (qs & 0x0F).reshape(rows, supers * 8, 32)
    scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, supers * 8)
    offsets = -(dmin[..., None] * mins.astype(np.float32)).reshape(rows, supers * 8)
    return values, scales, offsets


def iterate_gguf_weights(
    path: Path,
    config: ModelConfig,
    slice_for: Callable[[str], tuple[int, int, int] | None] | None = None,
    packed: PackedScheme | None = None,
    fused_parts: FusedParts | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized, but for
    the projections `packed` (`gguf_packed_scheme`) keeps packed (4- or 8-bit): their `qweight`,
    `scales` and `zeros`. With `slice_for` (tensor parallelism) only that (dim, start,
    length) slice is returned: row slices are cut from the quantized rows before
    dequantizing; column slices after. A tensor `fused_parts` splits (Phi-3's qkv and gate/up)
    comes as its parts. Gemma's norms lose the 1 llama.cpp's converter added to them."""
    reader = _open(path)
    gemma = config.architecture.startswith("gemma")
    for tensor in reader.tensors:
        experts = _EXPERT_TENSOR.fullmatch(tensor.name)
        if experts is not None:
            yield from _expert_weights(path, tensor, experts, slice_for)
            continue
        hf_name = gguf_to_hf_name(tensor.name, config.architecture)
        if hf_name is None:
            continue
        parts = fused_parts(hf_name) if fused_parts is not None else None
        pieces = [(hf_name, tensor.data)] if parts is None else [
            (name, tensor.data[first : first + rows]) for name, first, rows in parts
        ]  # fmt: skip
        for name, data in pieces:
            for out_name, out in _tensor_part(path, tensor, name, data, config, slice_for, packed):
                shift = gemma and out_name.endswith("norm.weight")
                yield out_name, out - 1.0 if shift else out


def _tensor_part(
    path: Path,
    tensor: Any,
    hf_name: str,
    data: np.ndarray,
    config: ModelConfig,
    slice_for: Callable[[str], tuple[int, int, int] | None] | None,
    packed: PackedScheme | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensor `hf_name` from its rows `data` of the file's `tensor`: this rank's
    slice, packed or dequantized, Q and K un-permuted."""
    part = slice_for(hf_name) if slice_for is not None else None
    if part is not None and part[0] == 0:  # whole rows (and whole heads): quantized as is
        data = data[part[1] : part[1] + part[2]]
    permuted = config.architecture in _PERMUTED and hf_name.endswith(
        ("q_proj.weight", "k_proj.weight")
    )
    module = hf_name.removesuffix(".weight")
    if packed is not None and hf_name.endswith("_proj.weight") and packed.quantizes(module):
        if part is not None and part[0] == 1:  # (whole blocks of inputs)
            unit = _BLOCK_INPUTS[GGMLQuantizationType(tensor.tensor_type)]
            block_bytes = data.shape[1] * unit // config_inputs(tensor)
            if part[1] % unit or part[2] % unit:
                raise ValueError(
                    f"{hf_name}: this rank's inputs {part[1]}..{part[1] + part[2]} do not "
                    f"fall on the file's blocks of {unit}; choose a tensor parallel size "
                    "that splits the layers on them"
                )
            first, count = part[1] // unit, part[2] // unit
            data = data[:, first * block_bytes : (first + count) * block_bytes]
        if permuted:
            data = reverse_permute_qk(data, data.shape[0] // config.head_dim)
        bits = packed.bits_for((module,))
        qweight, scales, zeros = gguf_to_packed(data, tensor.tensor_type, bits)
        yield f"{module}.qweight", qweight
        yield f"{module}.scales", scales
        yield f"{module}.zeros", zeros
        return
    array = _dequantized(path, tensor, data)
    if permuted:
        heads = array.shape[0] // config.head_dim  # (a row slice holds whole heads)
        array = reverse_permute_qk(array, heads)
    if part is not None and part[0] == 1:
        array = array[:, part[1] : part[1] + part[2]]
    yield hf_name, torch.from_numpy(np.ascontiguousarray(array))


def _expert_weights(
    path: Path,
    tensor: Any,
    match: re.Match[str],
    slice_for: Callable[[str], tuple[int, int, int] | None] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor as each expert's Hugging Face tensor (dequantized; with
    `slice_for`, this rank's slice of each)."""
    layer, kind = match.groups()
    array = _dequantized(path, tensor, tensor.data)  # [E, rows, inputs]
    for expert in range(array.shape[0]):
        name = f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"
        part = slice_for(name) if slice_for is not None else None
        weight = array[expert]
        if part is not None:
            dim, start, length = part
            weight = (
                weight[start : start + length] if dim == 0 else weight[:, start : start + length]
            )
        yield name, torch.from_numpy(np.ascontiguousarray(weight))


def _dequantized(path: Path, tensor: Any, data: np.ndarray) -> np.ndarray:
    """`data` (a tensor of the file, or rows of it) in float32 (a copy: the reader
    memory-maps the file read-only)."""
    try:
        array = dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        tested = ", ".join(TESTED_TYPES)
        raise ValueError(
            f"{path}: tensor {tensor.name} has type {kind}, which kvfleet cannot dequantize "
            f"(tested: {tested})"
        ) from None
    return np.array(array, dtype=np.float32, copy=True)


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """A GGUF tensor's Hugging Face name for architecture `arch` (GGUF's or ours); None for a
    tensor that is no parameter (Phi-3's LongRoPE factors, read into the config)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name in ROPE_FACTOR_TENSORS and arch == "phi3":
        return None
    legacy = _LEGACY_EXPERT_TENSOR.fullmatch(name)
    if legacy is not None:
        layer, kind, expert = legacy.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"
    names = _LAYER_NAMES
    if arch.startswith("gemma"):
        names = {**names, **_GEMMA_LAYER_NAMES}
    elif arch == "phi3":
        names = {**names, **_PHI3_LAYER_NAMES}
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unknown GGUF tensor {name!r} for a {arch} model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unfused_modules(module: str) -> tuple[str, ...]:
    """The projections a fused checkpoint module (Phi-3's) holds; itself otherwise."""
    owner, _, proj = module.rpartition(".")
    return tuple(f"{owner}.{part}" for part in _FUSED.get(proj, (proj,)))


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
