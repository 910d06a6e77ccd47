"""Quantization on the model families beyond Llama (CPU, float32): INT4 rounded at load
(`quantization="rtn"`) on Qwen3, Gemma 2, Gemma 3 and Phi-3 (its fused projections cut, then
each part rounded) computes what transformers computes with the same rounded weights; a
mixture of experts asks for quantization and is refused, named, before anything loads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.layers.quantization.packed import quantize_rtn
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams


def _rounded(model: Any) -> Any:
    """A copy of the transformers model whose attention and MLP projections hold their INT4
    round-to-nearest weights (group 128, or 64 / 32 where a layer's inputs need: as the engine
    picks them)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in rounded.named_modules():
            if not (isinstance(module, torch.nn.Linear) and name.endswith("_proj")):
                continue
            inputs = module.weight.shape[1]
            group = next(g for g in (128, 64, 32) if inputs % g == 0)
            weights = quantize_rtn(module.weight, group, torch.float32)
            module.weight.copy_(weights.dequantize().t())
    return rounded


@pytest.mark.parametrize(
    "family",
    ["qwen3-qk-norm-yarn", "gemma2-softcap-windows", "gemma3-local-global", "phi3-longrope"],
)
def test_int4_at_load_on_the_dense_families(
    family: str,
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    logprob_gap: Callable[..., float],
) -> None:
    """(A 60-token prompt: past the Gemma windows and Phi-3's original context of 48.)"""
    model, folder = hf_model_dir(family)
    prompt = [5 + (13 * i) % 370 for i in range(60)]
    llm = LLM(
        str(folder),
        dtype="float32",
        quantization="rtn",
        skip_tokenizer_init=True,
        num_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    (output,) = llm.generate(prompt, params)
    assert logprob_gap(_rounded(model), prompt, output.outputs[0]) < 1e-4


@pytest.mark.parametrize("family", ["mixtral-moe", "qwen3-moe-dense-layer"])
def test_quantizing_a_mixture_of_experts_is_refused(
    family: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    _, folder = hf_model_dir(family)
    with pytest.raises(ValueError, match=r"quantization \(int4.*mixture-of-experts.*without"):
        LLM(str(folder), dtype="float32", quantization="rtn", skip_tokenizer_init=True)
