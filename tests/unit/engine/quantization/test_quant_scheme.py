"""The `quantization` setting and a checkpoint's `quantization_config`, reconciled before any
weight loads: each published FP8 layout read into its scheme, and clear errors (naming what is
supported) for what kvfleet cannot serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.layers.quantization.scheme import Fp8Scheme, resolve_quantization
from kvfleet.engine.llm import LLM
from kvfleet.engine.parallel.partition import TPPlan
from tests.unit.engine.quantization.checkpoints import TINY


def _ct(weights: dict[str, Any], inputs: dict[str, Any] | None, **top: Any) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
        "ignore": ["lm_head"],
        **top,
    }


FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}


def test_each_published_fp8_layout_is_read() -> None:
    assert resolve_quantization("fp8", None) == Fp8Scheme("channel", "token", "online")
    assert resolve_quantization(None, None) is None
    channel = _ct(
        {**FP8_ARGS, "strategy": "channel", "dynamic": False},
        {**FP8_ARGS, "strategy": "token", "dynamic": True},
    )
    assert resolve_quantization(None, channel) == Fp8Scheme(
        "channel", "token", "compressed-tensors", ignore=("lm_head",)
    )
    static = _ct(
        {**FP8_ARGS, "strategy": "tensor", "dynamic": False},
        {**FP8_ARGS, "strategy": "tensor", "dynamic": False},
    )
    assert resolve_quantization("fp8", static).activations == "static"
    block = _ct(
        {**FP8_ARGS, "strategy": "block", "block_structure": [128, 128], "dynamic": False},
        {**FP8_ARGS, "strategy": "group", "group_size": 128, "dynamic": True},
    )
    assert resolve_quantization(None, block) == Fp8Scheme(
        "block", "group", "compressed-tensors", (128, 128), ("lm_head",)
    )
    deepseek = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}  # fmt: skip
    scheme = resolve_quantization(None, deepseek)
    assert scheme == Fp8Scheme("block", "group", "fp8", (128, 128))
    assert "fp8 checkpoint; 128x128 block weight scales" in scheme.describe()
    autofp8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    assert resolve_quantization(None, autofp8) == Fp8Scheme(
        "channel", "static", "fp8", ignore=("lm_head",)
    )


def test_ignore_lists_match_names_and_patterns() -> None:
    scheme = Fp8Scheme("channel", "token", "compressed-tensors",
                       ignore=("lm_head", "re:.*layers\\.3\\..*", "mlp.down_proj"))  # fmt: skip
    assert not scheme.quantizes("lm_head")
    assert not scheme.quantizes("model.layers.3.self_attn.q_proj")
    assert not scheme.quantizes("model.layers.0.mlp.down_proj")
    assert scheme.quantizes("model.layers.0.mlp.up_proj")
    assert scheme.quantizes("model.layers.13.self_attn.q_proj")


@pytest.mark.parametrize(
    ("method", "config", "error"),
    [
        ("int3", None, r"unknown quantization method 'int3'; supported: fp8"),
        (None, {"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes'.*supported"),
        (None, {"quant_method": "fp8", "fmt": "e5m2"}, r"'e5m2' is not supported; kvfleet reads"),
        (None, {"quant_method": "fp8", "activation_scheme": "static",
                "weight_block_size": [128, 128]}, r"weight_block_size need dynamic"),
        (None, {"quant_method": "fp8", "weight_block_size": [128]}, r"two positive integers"),
        (None, _ct({**FP8_ARGS, "strategy": "channel"}, None), r"weight-only .* not supported"),
        (None, _ct({**FP8_ARGS, "strategy": "group"}, None), r"weight strategy 'group'"),
        (None, _ct({"num_bits": 4, "type": "int"}, None, format="pack-quantized"),
         r"format 'pack-quantized' is not supported"),
        (None, _ct({**FP8_ARGS, "num_bits": 4, "strategy": "channel"},
                   {**FP8_ARGS, "strategy": "token", "dynamic": True}), r"with 4 bits"),
        (None, _ct({**FP8_ARGS, "strategy": "block", "block_structure": [128, 128]},
                   {**FP8_ARGS, "strategy": "group", "group_size": 64, "dynamic": True}),
         r"group size 64 differs from the weight block's 128"),
        (None, _ct({**FP8_ARGS, "strategy": "channel"},
                   {**FP8_ARGS, "strategy": "token", "dynamic": False}), r"is not supported"),
    ],
)  # fmt: skip
def test_what_kvfleet_cannot_serve_is_named(
    method: str | None, config: dict[str, Any] | None, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        resolve_quantization(method, config)


def test_the_setting_is_checked_with_the_other_settings() -> None:
    with pytest.raises(ValueError, match=r"unknown quantization method 'awq4'; supported: fp8"):
        EngineConfig("m", quantization="awq4")
    assert EngineConfig.from_kwargs("m", {"quantization": "fp8"}).quantization == "fp8"


def test_fp8_on_the_cpu_is_refused_before_anything_loads(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))  # (no weights: none is read)
    with pytest.raises(
        ValueError,
        match=r"at load.* cannot run here: FP8 needs a CUDA GPU of compute capability 8\.9",
    ):
        LLM(str(tmp_path), load_format="dummy", quantization="fp8", device="cpu")


def test_tensor_parallel_ranks_take_their_scales() -> None:
    from kvfleet.engine.config import ModelConfig

    config = ModelConfig.from_hf_config(TINY)  # q 4 heads x 64, kv 2 x 64, MLP 512
    plan = TPPlan.build(config, 1, 2)
    layer = "model.layers.0"
    # per-channel scales follow their weight's output rows; a row-parallel layer keeps all
    assert plan.slice_for(f"{layer}.self_attn.k_proj.weight_scale") == (0, 64, 64)
    assert plan.slice_for(f"{layer}.mlp.up_proj.weight_scale") == (0, 256, 256)
    assert plan.slice_for(f"{layer}.mlp.down_proj.weight_scale") is None
    assert plan.slice_for(f"{layer}.self_attn.o_proj.input_scale") is None
    # block scales follow in blocks, along either dimension
    block = (128, 128)
    assert plan.slice_for(f"{layer}.mlp.up_proj.weight_scale_inv", block) == (0, 2, 2)
    assert plan.slice_for(f"{layer}.mlp.down_proj.weight_scale_inv", block) == (1, 2, 2)
    with pytest.raises(ValueError, match=r"do not fall on the checkpoint's 128x128 scale blocks"):
        plan.slice_for(f"{layer}.self_attn.k_proj.weight_scale_inv", block)


def test_tensor_parallel_ranks_take_their_int4_tensors() -> None:
    """AWQ / GPTQ tensors follow their weight in their own layouts (rank 1 of 2: q 128..256,
    kv 64..128, MLP 256..512; o and down split their inputs); 8-bit GPTQ packs four to a
    word."""
    from kvfleet.engine.config import ModelConfig

    plan = TPPlan.build(ModelConfig.from_hf_config(TINY), 1, 2)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    gptq, awq, gptq8 = ("gptq", 64, 4), ("awq", 64, 4), ("gptq", 64, 8)
    assert plan.slice_for(f"{attn}.k_proj.qweight", packed=gptq) == (1, 64, 64)  # [K/8, N]
    assert plan.slice_for(f"{attn}.k_proj.qweight", packed=awq) == (1, 8, 8)  # [K, N/8]
    assert plan.slice_for(f"{attn}.k_proj.qzeros", packed=gptq) == (1, 8, 8)
    assert plan.slice_for(f"{attn}.k_proj.scales", packed=gptq) == (1, 64, 64)
    assert plan.slice_for(f"{attn}.k_proj.g_idx", packed=gptq) is None
    assert plan.slice_for(f"{attn}.o_proj.qweight", packed=gptq) == (0, 16, 16)  # (inputs / 8)
    assert plan.slice_for(f"{attn}.o_proj.qweight", packed=awq) == (0, 128, 128)
    assert plan.slice_for(f"{attn}.o_proj.scales", packed=gptq) == (0, 2, 2)  # (groups of 64)
    assert plan.slice_for(f"{attn}.o_proj.g_idx", packed=gptq) == (0, 128, 128)
    assert plan.slice_for(f"{attn}.k_proj.qzeros", packed=gptq8) == (1, 16, 16)  # [K/g, N/4]
    assert plan.slice_for(f"{attn}.o_proj.qweight", packed=gptq8) == (0, 32, 32)  # (inputs / 4)
    assert plan.slice_for(f"{mlp}.down_proj.qzeros", packed=("gptq", -1, 4)) is None  # (1 group)
    with pytest.raises(ValueError, match="do not fall on the checkpoint's units of 256"):
        plan.slice_for(f"{attn}.o_proj.scales", packed=("gptq", 256, 4))
