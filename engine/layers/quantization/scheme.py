"""Which quantization a model is served with: the `quantization` setting and the checkpoint's
`quantization_config`, reconciled before any weight loads (torch-free).

FP8 comes from three places: a bf16/fp16 checkpoint quantized at load (`quantization="fp8"`),
a compressed-tensors checkpoint as llm-compressor writes it (`quant_method:
"compressed-tensors"`, float-quantized), or the `quant_method: "fp8"` format (per-tensor scales,
or `weight_block_size` [128, 128] with `weight_scale_inv`, as DeepSeek and Qwen publish).

Integer weight-only (W4A16, W8A16) comes from AWQ checkpoints (`quant_method: "awq"`, GEMM
packing, as AutoAWQ writes them), GPTQ checkpoints (`quant_method: "gptq"`, 4 or 8 bits,
symmetric or not, any group size, `desc_act`, as AutoGPTQ / GPTQModel write them), or a
bf16/fp16 checkpoint rounded to 4 bits at load (`quantization="rtn"`: group 128 with zero
points, AWQ's form), or a GGUF file's Q4_0 / Q4_1 / Q4_K projections kept 4-bit and Q8_0 ones
8-bit (`quantization="gguf"`: engine/loader/gguf.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "rtn", "gguf")
CHECKPOINT_FORMATS = ("compressed-tensors (float-quantized, 8-bit)", "fp8", "awq", "gptq")
RTN_GROUP_SIZE = 128


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 (e4m3) weights and activations.

    `weights`: "channel" (a float32 scale per output row; a checkpoint's per-tensor scale is
    spread over its rows) or "block" (one scale per `block` = (rows, cols) tile).
    `activations`: "token" (dynamic, a scale per token), "group" (dynamic, a scale per token
    and `block[1]` input columns; with block weights) or "static" (the checkpoint's one scale
    per layer).
    """

    weights: str
    activations: str
    source: str  # "online", "compressed-tensors" or "fp8" (the checkpoint's quant_method)
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()  # checkpoint modules left unquantized (names or "re:" patterns)

    method = "fp8"

    @property
    def from_checkpoint(self) -> bool:
        return self.source != "online"

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. "model.layers.0.self_attn.q_proj") is
        quantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or module.endswith("." + entry):
                return False
        return True

    def describe(self) -> str:
        weights = (
            f"{self.block[0]}x{self.block[1]} block weight scales"
            if self.block is not None
            else "per-channel weight scales"
        )
        activations = {
            "token": "dynamic per-token activation scales",
            "group": f"dynamic per-token activation scales per {self.block and self.block[1]} "
            "columns",
            "static": "static activation scales",
        }[self.activations]
        origin = "quantized at load" if self.source == "online" else f"{self.source} checkpoint"
        return f"fp8 e4m3 ({origin}; {weights}, {activations})"

    def labels(self) -> dict[str, str]:
        """For `/v1/models` metadata and metric labels."""
        return {
            "method": self.method,
            "source": self.source,
            "weights": "block" if self.block else "channel",
            "activations": self.activations,
        }


@dataclass(frozen=True)
class PackedScheme:
    """Packed integer weights (W4A16, or W8A16): `group_size` inputs share a scale and zero
    point (-1: all of a layer's inputs); `source` "awq", "gptq", "gguf" or "online" (rounded
    to nearest at load);
    `zero_offset` 1 where a GPTQ checkpoint stores zeros minus one (its original format);
    `act_order`: GPTQ's desc_act (the input permuted by `g_idx`); `bits` 8: a GPTQ checkpoint
    of 8-bit values (W8A16, four to a word); `eight_bit`: modules held in 8-bit words in a
    4-bit scheme (a GGUF file's Q8_0 layers, and the fused layers they share with Q4 parts: a
    4-bit value fits 8 bits exactly)."""

    source: str
    group_size: int
    zero_offset: int = 0
    act_order: bool = False
    ignore: tuple[str, ...] = ()
    bits: int = 4
    eight_bit: tuple[str, ...] = ()

    def bits_for(self, modules: tuple[str, ...]) -> int:
        """The bits per value of the layer holding these checkpoint modules."""
        if self.bits == 8 or any(_listed(module, self.eight_bit) for module in modules):
            return 8
        return 4

    @property
    def method(self) -> str:
        return "rtn" if self.source == "online" else self.source

    @property
    def from_checkpoint(self) -> bool:
        return self.source != "online"

    def quantizes(self, module: str) -> bool:
        return not _listed(module, self.ignore)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        if self.eight_bit:
            group += f"; {len(self.eight_bit)} projections 8-bit"
        if self.source == "online":
            group += " (64 or 32 where a layer's inputs need)"
        origin = (
            "rounded to nearest at load" if self.source == "online" else f"{self.source} checkpoint"
        )
        order = ", act-order" if self.act_order else ""
        return f"int{self.bits} weight-only ({origin}; {group}{order})"

    def labels(self) -> dict[str, str]:
        return {
            "method": self.method,
            "source": self.source,
            "weights": f"int{self.bits}",
            "activations": "none",
        }


QuantScheme = Fp8Scheme | PackedScheme


def resolve_quantization(
    method: str | None, checkpoint: Mapping[str, Any] | None
) -> QuantScheme | None:
    """The scheme for the `quantization` setting `method` (None: the checkpoint's) and the
    checkpoint's `quantization_config` (None: an unquantized checkpoint). ValueError when they
    disagree or either names something kvfleet cannot serve."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization method {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if checkpoint is None:
        if method is None:
            return None
        if method == "rtn":
            return PackedScheme(source="online", group_size=RTN_GROUP_SIZE)
        if method == "gguf":
            raise ValueError(
                "quantization='gguf' keeps a GGUF file's Q4_0 / Q4_1 / Q4_K layers 4-bit and "
                "Q8_0 layers 8-bit; this model is not a GGUF file"
            )
        if method != "fp8":
            raise ValueError(
                f"quantization={method!r} serves {method.upper()} checkpoints, and this one is "
                "not quantized; to quantize it at load use 'fp8' (W8A8) or 'rtn' (INT4 "
                "weight-only)"
            )
        return Fp8Scheme(weights="channel", activations="token", source="online")
    scheme = _from_checkpoint(checkpoint)
    if scheme is None:  # (a checkpoint quantizing its KV cache only)
        return resolve_quantization(method, None)
    if method is not None and method != scheme.method:
        raise ValueError(
            f"quantization={method!r} disagrees with the checkpoint, which is quantized with "
            f"{scheme.describe()}; leave quantization unset to serve the checkpoint as it is"
        )
    return scheme


def _from_checkpoint(config: Mapping[str, Any]) -> QuantScheme | None:
    quant_method = config.get("quant_method")
    if quant_method == "compressed-tensors":
        return _compressed_tensors(config)
    if quant_method == "fp8":
        return _fp8_format(config)
    if quant_method in ("awq", "gptq"):
        return _int4_format(quant_method, config)
    raise ValueError(
        f"the checkpoint's quantization_config has quant_method {quant_method!r}, which kvfleet "
        f"cannot serve; supported checkpoint formats: {'; '.join(CHECKPOINT_FORMATS)}"
    )


def _fp8_format(config: Mapping[str, Any]) -> Fp8Scheme:
    """`quant_method: "fp8"`: `activation_scheme` dynamic or static, `weight_block_size`."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported; kvfleet reads e4m3")
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise ValueError(
            f"fp8 checkpoint activation_scheme {activation!r}: supported are dynamic and static"
        )
    ignore = _names(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme(
            weights="channel",
            activations="token" if activation == "dynamic" else "static",
            source="fp8",
            ignore=ignore,
        )
    block_shape = _block_shape(block)
    if activation != "dynamic":
        raise ValueError("fp8 checkpoints with weight_block_size need dynamic activations")
    return Fp8Scheme(
        weights="block", activations="group", source="fp8", block=block_shape, ignore=ignore
    )


def _int4_format(quant_method: str, config: Mapping[str, Any]) -> PackedScheme:
    """AutoAWQ's and AutoGPTQ's `quantization_config`."""
    bits = config.get("bits", config.get("w_bit"))
    widths = (4, 8) if quant_method == "gptq" else (4,)
    if bits not in widths:
        raise ValueError(
            f"{quant_method} checkpoints with {bits} bits are not supported; kvfleet reads "
            f"{' and '.join(map(str, widths))}-bit ones"
        )
    group = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise ValueError(
            f"{quant_method} group size {group!r} is not supported: -1 or a multiple of 8"
        )
    ignore = _names(config.get("modules_to_not_convert") or ())
    if quant_method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r} is not supported; kvfleet reads the GEMM packing"
            )
        if config.get("zero_point", True) is not True:
            raise ValueError("AWQ checkpoints without zero points are not supported")
        return PackedScheme(source="awq", group_size=group, ignore=ignore)
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: gptq, gptq_v2")
    return PackedScheme(
        source="gptq",
        group_size=group,
        zero_offset=1 if fmt == "gptq" else 0,
        act_order=bool(config.get("desc_act", False)),
        ignore=ignore,
        bits=bits,
    )


def _compressed_tensors(config: Mapping[str, Any]) -> Fp8Scheme | None:
    """llm-compressor's layout: `config_groups` of `targets` with `weights` and
    `input_activations` quantization arguments, a `format`, an `ignore` list."""
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported; kvfleet reads float-quantized "
            "(FP8) checkpoints"
        )
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        if config.get("kv_cache_scheme"):  # (only the KV cache's scales: weights as they are)
            return None
        raise ValueError("the compressed-tensors quantization_config has no config_groups")
    schemes = {_ct_group(group) for group in groups}
    if len(schemes) != 1:
        raise ValueError(
            "compressed-tensors checkpoints whose config groups quantize layers differently are "
            "not supported"
        )
    weights, activations, block = schemes.pop()
    return Fp8Scheme(
        weights=weights,
        activations=activations,
        source="compressed-tensors",
        block=block,
        ignore=_names(config.get("ignore") or ()),
    )


def _ct_group(group: Mapping[str, Any]) -> tuple[str, str, tuple[int, int] | None]:
    targets = group.get("targets") or []
    if "Linear" not in targets and not all(str(t).startswith("re:") for t in targets):
        raise ValueError(f"compressed-tensors targets {targets} are not supported (Linear)")
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    if group.get("output_activations"):
        raise ValueError("compressed-tensors output activation quantization is not supported")
    _expect_fp8(weights, "weights")
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    strategy = weights.get("strategy")
    block: tuple[int, int] | None = None
    if strategy in ("channel", "tensor"):
        weight_kind = "channel"
    elif strategy == "block":
        weight_kind = "block"
        block = _block_shape(weights.get("block_structure"))
    else:
        raise ValueError(
            f"compressed-tensors FP8 weight strategy {strategy!r} is not supported; "
            "supported: channel, tensor, block"
        )
    if inputs is None:
        raise ValueError(
            "compressed-tensors FP8 weight-only checkpoints (W8A16) are not supported; kvfleet "
            "serves FP8 weights with FP8 activations (W8A8)"
        )
    _expect_fp8(inputs, "input_activations")
    input_strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if dynamic and input_strategy in ("token", "tensor") and block is None:
        activations = "token"  # (a per-tensor dynamic scale is read finer, per token)
    elif not dynamic and input_strategy == "tensor" and block is None:
        activations = "static"
    elif dynamic and input_strategy == "group" and block is not None:
        if inputs.get("group_size") != block[1]:
            raise ValueError(
                f"compressed-tensors activation group size {inputs.get('group_size')} differs "
                f"from the weight block's {block[1]} columns"
            )
        activations = "group"
    else:
        raise ValueError(
            f"compressed-tensors activation quantization (strategy {input_strategy!r}, "
            f"dynamic {dynamic}) with {strategy!r} weights is not supported; supported: "
            "dynamic per-token or static per-tensor with channel/tensor weights, dynamic "
            "groups with block weights"
        )
    return weight_kind, activations, block


def _expect_fp8(args: Mapping[str, Any], what: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors {what} of type {args.get('type')!r} with "
            f"{args.get('num_bits')} bits are not supported; kvfleet reads 8-bit float (FP8)"
        )
    if args.get("symmetric") is False:
        raise ValueError(f"compressed-tensors asymmetric FP8 {what} are not supported")


def _block_shape(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, Sequence)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"a weight block size is two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"a list of ignored modules is a list of names, got {value!r}")
    return tuple(str(v) for v in value)


def _listed(module: str, entries: tuple[str, ...]) -> bool:
    return any(module == entry or module.endswith("." + entry) for entry in entries)
