"""AWQ and GPTQ checkpoints (symmetric and not, act-order, the v1 and v2 zero formats), written
as AutoAWQ and AutoGPTQ pack them (their loops, over plain integers: tests/unit/engine/
quantization/test_int4_layouts.py), load into kvfleet's INT4 layers and compute what a float32
model holding the dequantized weights computes. transformers cannot be the oracle here: it reads
these formats only through optimum/gptqmodel or autoawq, CUDA packages not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.layers.quantization.packed import PackedLinear, quantize_rtn
from kvfleet.engine.layers.quantization.scheme import resolve_quantization
from kvfleet.engine.loader.model_loader import load_model
from kvfleet.engine.loader.source import ModelSource
from kvfleet.engine.worker.setup import _attention_factory
from tests.unit.engine.quantization.checkpoints import PROJECTIONS, _write, random_llama
from tests.unit.engine.quantization.test_fp8_checkpoints import _logits
from tests.unit.engine.quantization.test_int4_layouts import _gptq_pack_rows, _pack_columns

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# (the fused layers' parts share their input, hence their act-order permutation)
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}  # fmt: skip


def _quantize(
    weight: torch.Tensor, group: int, sym: bool, bits: int = 4
) -> tuple[torch.Tensor, ...]:
    """Round to nearest as the tools do: w [out, in] -> q [in, out], zeros and scales
    [in / g, out] (fp16 scales)."""
    top = 2**bits - 1
    w = weight.t().reshape(-1, group, weight.shape[0])  # [groups, g, out]
    if sym:
        scales = (w.abs().amax(dim=1) / (top / 2)).clamp_min(1e-6).half()
        zeros = torch.full_like(scales, (top + 1) // 2, dtype=torch.int64)
    else:
        low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
        scales = ((high - low) / top).clamp_min(1e-6).half()
        zeros = (-low / scales.float()).round().clamp(0, top).long()
    q = (w / scales.float()[:, None] + zeros[:, None]).round().clamp(0, top).long()
    return q.reshape(weight.shape[1], weight.shape[0]), zeros, scales


def _write_int4(
    folder: Path,
    state: dict[str, torch.Tensor],
    fmt: str,
    group: int,
    sym: bool,
    act_order: bool,
    bits: int = 4,
) -> dict[str, torch.Tensor]:
    """The checkpoint and the float32 weights it holds (dequantized, [out, in])."""
    tensors: dict[str, torch.Tensor] = {}
    dense = dict(state)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    for name, weight in state.items():
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if kind != "weight" or proj not in PROJECTIONS:
            tensors[name] = weight
            continue
        in_features = weight.shape[1]
        g_idx = torch.arange(in_features) // group
        if act_order:  # (one permutation per input: a layer's, the same for its fused parts)
            key = (module.split(".")[2], INPUT_OF[proj])
            if key not in perms:
                perms[key] = torch.randperm(
                    in_features, generator=torch.Generator().manual_seed(len(perms))
                )
            g_idx = g_idx[perms[key]]
        # (each input row k quantized with its group g_idx[k]'s scale and zero)
        sorted_w = weight[:, torch.argsort(g_idx, stable=True)]
        q_sorted, zeros, scales = _quantize(sorted_w, group, sym, bits)
        q = torch.empty_like(q_sorted)
        q[torch.argsort(g_idx, stable=True)] = q_sorted
        dense[name] = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()
        if fmt == "awq":
            tensors[f"{module}.qweight"] = _pack_columns(q, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = _pack_columns(zeros, AWQ_ORDER)
        else:
            stored = zeros - 1 if fmt == "gptq" else zeros
            tensors[f"{module}.qweight"] = _gptq_pack_rows(q, bits)
            tensors[f"{module}.qzeros"] = _pack_columns(stored, list(range(32 // bits)), bits)
            tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
        tensors[f"{module}.scales"] = scales
    if fmt == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    else:
        config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                  "sym": sym, "checkpoint_format": fmt, "static_groups": False,
                  "true_sequential": True}  # fmt: skip
    _write(folder, tensors, config)
    return dense


def _load(folder: Path, dense: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    source = ModelSource("hf", folder, "tiny")
    config = source.read_config()
    scheme = resolve_quantization(None, config.quantization_config) if dense is None else None
    if dense is not None:
        _write(folder / "dense", dense, None)  # type: ignore[arg-type]
        source = ModelSource("hf", folder / "dense", "tiny")
        config = source.read_config()
    return load_model(source, config, torch.float32, torch.device("cpu"),
                      _attention_factory("torch"), quantization=scheme)  # fmt: skip


CASES = [
    ("awq", 64, False, False, 4),
    ("gptq", 128, True, False, 4),  # (symmetric: zero 8, stored as 7 in the v1 format)
    ("gptq", 64, False, True, 4),  # (act-order)
    ("gptq_v2", 32, False, True, 4),
    ("gptq", 128, True, False, 8),  # (8-bit: zero 128, stored as 127)
    ("gptq_v2", 64, False, True, 8),
]


@pytest.mark.parametrize(("fmt", "group", "sym", "act_order", "bits"), CASES)
def test_an_int4_checkpoint_computes_what_its_dequantized_weights_compute(
    tmp_path: Path, fmt: str, group: int, sym: bool, act_order: bool, bits: int
) -> None:
    """(and GPTQ's 8-bit checkpoints: W8A16, four values to a word)"""
    state = random_llama()
    dense = _write_int4(tmp_path, state, fmt, group, sym, act_order, bits)
    ours = _load(tmp_path)
    layers = [m for m in ours.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 8  # (qkv, o, gate_up, down in each of 2 layers)
    assert {layer.bits for layer in layers} == {bits}
    assert (layers[0].perm is not None) == act_order
    reference = _load(tmp_path, dense)
    got, want = _logits(ours, True), _logits(reference, True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # (and not by chance: the float32 model's own weights give other logits)
    assert (_logits(_load(tmp_path, state), True) - want).abs().max() > 1e-2


def test_int4_checkpoint_errors(tmp_path: Path) -> None:
    state = random_llama()
    _write_int4(tmp_path, state, "gptq", 64, False, True)
    with pytest.raises(ValueError, match="disagrees with the checkpoint"):
        resolve_quantization("awq", {"quant_method": "gptq", "bits": 4, "group_size": 64})
    with pytest.raises(ValueError, match="with 3 bits are not supported; kvfleet reads 4 and 8"):
        resolve_quantization(None, {"quant_method": "gptq", "bits": 3, "group_size": 64})
    with pytest.raises(ValueError, match="awq checkpoints with 8 bits are not supported"):
        resolve_quantization(None, {"quant_method": "awq", "bits": 8, "group_size": 64})
    with pytest.raises(ValueError, match="version 'gemv' is not supported"):
        resolve_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 64,
                                    "version": "gemv"})  # fmt: skip
    with pytest.raises(ValueError, match="this one is not quantized"):
        resolve_quantization("awq", None)
    # a fused layer whose parts disagree on g_idx cannot run as one layer
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="different g_idx"):
        _load(tmp_path)


def test_rtn_quantizes_a_float_checkpoint_at_load(tmp_path: Path) -> None:
    """`quantization="rtn"`: INT4 (group 128, zero points) rounded from the float32 weights
    as they load (each weight within half a step: test_int4_layouts.py): the model computes
    what the rounded weights compute."""
    state = random_llama()
    _write(tmp_path, state, None)  # type: ignore[arg-type]
    source = ModelSource("hf", tmp_path, "tiny")
    config = source.read_config()
    scheme = resolve_quantization("rtn", config.quantization_config)
    assert scheme is not None
    assert scheme.describe() == (
        "int4 weight-only (rounded to nearest at load; group 128 (64 or 32 where a layer's "
        "inputs need))"
    )
    ours = load_model(source, config, torch.float32, torch.device("cpu"),
                      _attention_factory("torch"), quantization=scheme)  # fmt: skip
    assert sum(isinstance(m, PackedLinear) for m in ours.modules()) == 8
    rounded = {
        name: quantize_rtn(w, 128, torch.float32).dequantize().t().contiguous()
        if name.endswith("proj.weight")
        else w
        for name, w in state.items()
    }
    want = _logits(_load(tmp_path, rounded), True)
    torch.testing.assert_close(_logits(ours, True), want, rtol=1e-4, atol=1e-4)


def test_rtn_takes_a_smaller_group_where_the_layer_needs_it() -> None:
    """(SmolLM2's 576 inputs: 128 does not divide them, 64 does)"""
    from kvfleet.engine.layers.quantization.scheme import PackedScheme

    online = PackedScheme(source="online", group_size=128)
    assert PackedLinear(576, 64, False, torch.float32, online).group_size == 64
    assert PackedLinear(4096, 64, False, torch.float32, online).group_size == 128
    with pytest.raises(ValueError, match="cannot take group size 128"):
        PackedLinear(576, 64, False, torch.float32, PackedScheme(source="awq", group_size=128))


def test_lora_adds_to_an_int4_projection(tmp_path: Path) -> None:
    """A LoRA slot over an INT4 layer: its output plus x A^T B^T (slots in the model dtype)."""
    import numpy as np

    from kvfleet.engine.lora.adapter import LoRAAdapter
    from kvfleet.engine.lora.layers import LoRAContext, attach_lora
    from kvfleet.engine.lora.ops import LoRABatch

    _write_int4(tmp_path, random_llama(), "awq", 64, False, False)
    model = _load(tmp_path)
    context = LoRAContext()
    wrappers = attach_lora(model, max_loras=1, max_rank=4, context=context)
    qkv = next(
        w for w in wrappers if w.layer_index == 0 and w.targets == ("q_proj", "k_proj", "v_proj")
    )
    assert isinstance(qkv.base, PackedLinear)
    assert qkv.lora_a.dtype == torch.float32
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 256, generator=generator), torch.randn(128, 4, generator=generator)
    qkv.set_slot(0, LoRAAdapter("t", "t", 4, 1.0, {(0, "k_proj"): (a, b)}))
    x = torch.randn(3, 256, generator=generator)
    context.batch = LoRABatch.build(np.array([0, 1, 0]), 1, torch.device("cpu"))
    out, base = qkv(x), qkv.base(x)
    torch.testing.assert_close(out[1], base[1])
    k = slice(256, 384)  # (k's rows in the fused q | k | v output)
    torch.testing.assert_close(out[[0, 2]][:, k], base[[0, 2]][:, k] + x[[0, 2]] @ a.t() @ b.t())
    torch.testing.assert_close(out[:, :256], base[:, :256])
