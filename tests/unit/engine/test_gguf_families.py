"""GGUF files of Gemma 2, Gemma 3, Phi-3 and Mixtral (llama with experts), written from a random
transformers model as llama.cpp's converter (convert_hf_to_gguf.py) writes them, served and
compared with that model.

The writer below follows the converter: tensor names from gguf-py's own map (the converter's),
Gemma's norms stored plus 1, Q and K rows of llama-architecture models permuted, Mixtral's
experts stacked into one tensor per projection (or, as files converted before mid-2024 hold
them, one tensor per expert), Phi-3's fused qkv / gate_up as they are with its LongRoPE factors
as tensors and the attention factor in the metadata. Projections are Q8_0 (the model's own
weights rounded to it first, so the file holds them exactly), the rest float32. Where
transformers reads these families from GGUF itself, its reader must get back the model's
tensors from the same file: the writer is checked by an independent reader.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.config.gguf_metadata import model_config_from_gguf
from kvfleet.engine.layers.quantization.packed import PackedLinear
from kvfleet.engine.layers.torch_layers import rope_attention_factor
from kvfleet.engine.llm import LLM
from kvfleet.engine.loader.gguf import gguf_to_hf_name, read_gguf_config
from kvfleet.engine.sampling_params import SamplingParams
from tests.conftest import BASE, CONFIGS

# name -> (transformers config class, its arguments over conftest.BASE, GGUF architecture).
# Only what GGUF can say: the query scaled by head_dim^-0.5 (llama.cpp's rule below 27B),
# Gemma 3's windowed layers five of every six (llama.cpp's fixed pattern: 6 layers here).
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
        "gemma2",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
        "gemma3",
    ),
    # (as conftest's: Phi-3 with LongRoPE past an original context of 48; Mixtral, 2 of 4)
    "phi3-longrope": (*CONFIGS["phi3-longrope"], "phi3"),
    "mixtral": (*CONFIGS["mixtral-moe"], "llama"),
}
ARCHES = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
          "phi3": gguf.MODEL_ARCH.PHI3, "llama": gguf.MODEL_ARCH.LLAMA}  # fmt: skip


def build_model(family: str, folder: Path) -> Any:
    """A random float32 transformers model whose projections hold Q8_0-representable values,
    saved to `folder` (norms and biases random too)."""
    import transformers

    class_name, extra, _ = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**BASE, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
            elif _is_projection(name):
                param.copy_(torch.from_numpy(_q8_round_trip(param.numpy())))
    model.save_pretrained(folder)
    return model.eval()


def _is_projection(name: str) -> bool:
    return "_proj" in name or "experts" in name or ".w1" in name or ".w2" in name


def _q8_round_trip(weight: np.ndarray) -> np.ndarray:
    rows = weight.reshape(-1, weight.shape[-1])
    return dequantize(quantize(rows, Q.Q8_0), Q.Q8_0).reshape(weight.shape)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from (half, pair) to (pair, half)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(folder: Path, family: str, path: Path, per_expert_tensors: bool = False) -> None:
    """The GGUF file llama.cpp's converter makes of the Hugging Face folder `folder`."""
    config = json.loads((folder / "config.json").read_text())
    arch = FAMILIES[family][2]
    layers = int(config["num_hidden_layers"])
    writer = GGUFWriter(path, arch)
    _write_metadata(writer, config, arch)
    tensors = {name: t.numpy() for name, t in load_file(folder / "model.safetensors").items()}
    names = gguf.get_tensor_name_map(ARCHES[arch], layers)
    _write_experts(writer, tensors, config, names, per_expert_tensors)  # (popped from tensors)
    for hf_name, weight in tensors.items():
        if hf_name == "lm_head.weight" and arch.startswith("gemma"):
            continue  # (tied)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        stored = _as_converted(hf_name, weight, arch, config)
        if _is_projection(hf_name) and stored.ndim == 2:
            writer.add_tensor(name, quantize(stored, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer: GGUFWriter, config: dict[str, Any], arch: str) -> None:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    rope = config["rope_parameters"]
    if arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(int(config["sliding_window"]))
    else:
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if arch == "gemma3":  # (the global layers' base and scaling)
        rope = rope["full_attention"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "phi3":
        original = int(config["original_max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(0)
        scale = int(config["max_position_embeddings"]) / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "llama":
        writer.add_expert_count(int(config["num_local_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))


def _write_experts(
    writer: GGUFWriter,
    tensors: dict[str, np.ndarray],
    config: dict[str, Any],
    names: Any,
    per_expert_tensors: bool,
) -> None:
    """Each layer's experts stacked into one tensor per projection, as the converter does (or
    one tensor per expert, as older files hold them), taken out of `tensors`."""
    experts = int(config.get("num_local_experts") or 0)
    kinds = {"w1": "gate", "w2": "down", "w3": "up"}
    for layer, w in itertools.product(range(int(config["num_hidden_layers"])), kinds):
        stem = f"model.layers.{layer}.block_sparse_moe.experts"
        parts = [tensors.pop(f"{stem}.{e}.{w}.weight") for e in range(experts)]
        if not parts:
            continue
        if per_expert_tensors:
            for e, part in enumerate(parts):
                name = f"blk.{layer}.ffn_{kinds[w]}.{e}.weight"
                writer.add_tensor(name, quantize(part, Q.Q8_0), raw_dtype=Q.Q8_0)
            continue
        stacked = np.stack(parts)
        data = quantize(stacked.reshape(-1, stacked.shape[-1]), Q.Q8_0)
        name = names.get_name(f"{stem}.{w}.weight", try_suffixes=(".weight",))
        writer.add_tensor(name, data.reshape(*stacked.shape[:2], -1), raw_dtype=Q.Q8_0)


def _as_converted(
    hf_name: str, weight: np.ndarray, arch: str, config: dict[str, Any]
) -> np.ndarray:
    """A tensor as the converter stores it: Gemma's norms plus 1, a llama's Q and K permuted."""
    if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        return weight + 1
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        key = "num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"
        return _permute(weight, int(config[key]))
    return weight


# What the file must say as config.json does (besides the architecture)
COMPARED_FIELDS = (
    "layer_windows", "sliding_window", "rope_theta", "local_rope_theta", "query_pre_attn_scalar",
    "attn_logit_softcap", "final_logit_softcap", "num_experts", "num_experts_per_tok",
    "moe_layers", "head_dim", "qk_norm", "norm_offset", "sandwich_norms", "mlp_activation",
    "tie_word_embeddings",
)  # fmt: skip
CASES = [("gemma2", False), ("gemma3", False), ("phi3-longrope", False), ("mixtral", False),
         ("mixtral", True)]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "per_expert_tensors"),
    CASES,
    ids=["gemma2", "gemma3", "phi3-longrope", "mixtral", "mixtral-per-expert-tensors"],
)
def test_gguf_of_each_family_matches_transformers(
    tmp_path: Path, family: str, per_expert_tensors: bool, logprob_gap: Callable[..., float]
) -> None:
    """(A 60-token prompt: past Gemma's 24-token windows and Phi-3's original context of 48,
    where transformers turns to the long factors as the engine does for its whole life.)"""
    model = build_model(family, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_gguf(tmp_path / "hf", family, path, per_expert_tensors)
    config = read_gguf_config(path)
    expected = ModelConfig.from_hf_config(model.config.to_dict())
    if family == "phi3-longrope":  # (the converter's attention factor, in float32)
        assert config.rope_scaling is not None
        assert expected.rope_scaling is not None
        factor = config.rope_scaling["attention_factor"]
        assert factor == pytest.approx(rope_attention_factor(expected.rope_scaling), rel=1e-6)
        for key in ("rope_type", "original_max_position_embeddings", "factor"):
            assert config.rope_scaling[key] == expected.rope_scaling[key], key
        for key in ("long_factor", "short_factor"):  # (float32 in the file)
            assert config.rope_scaling[key] == pytest.approx(expected.rope_scaling[key], rel=1e-7)
    for field in COMPARED_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.architecture == expected.architecture

    prompt = [5 + (11 * i) % 370 for i in range(60)]
    with torch.no_grad():
        largest_logit = float(model(torch.tensor([prompt])).logits.abs().max())
    # (as test_gguf_loader.float32_bound: two matmuls a layer and the LM head, 6 layers at most)
    bound = 2**-24 * math.sqrt(BASE["intermediate_size"]) * 13 * max(largest_logit, 1.0)
    # dequantized at load, and (not for a mixture of experts: refused) kept 8-bit as the
    # file's Q8_0 blocks with quantization="gguf", Phi-3's fused rows cut from them
    for quantization in (None, "gguf") if config.num_experts == 0 else (None,):
        llm = LLM(
            str(path),
            dtype="float32",
            quantization=quantization,
            skip_tokenizer_init=True,
            num_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=16,
            block_size=8,
        )
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
        (output,) = llm.generate(prompt, params)
        assert logprob_gap(model, prompt, output.outputs[0]) < bound, quantization
        packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == (4 * config.num_hidden_layers if quantization else 0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3-longrope"])
def test_transformers_reads_the_written_files_back(tmp_path: Path, family: str) -> None:
    """The writer above checked by transformers' own GGUF reader (ported from llama.cpp's):
    the model's every tensor comes back from the file (Q8_0 exactly: the model holds Q8_0
    values). transformers does not read a llama file's experts (Mixtral)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = build_model(family, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_gguf(tmp_path / "hf", family, path)
    read = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    state = model.state_dict()
    assert (
        set(read) == set(state) - {"lm_head.weight"} if family.startswith("gemma") else set(state)
    )
    for name, tensor in read.items():
        assert torch.allclose(torch.as_tensor(tensor).float(), state[name], atol=1e-6), name


def test_gguf_metadata_read_as_llama_cpp_reads_it() -> None:
    """What GGUF leaves unsaid, as llama.cpp decides it: Gemma's 27B models scale the query by
    (hidden / heads)^-0.5 (told by their layer count), the rest by head_dim^-0.5; Gemma 2's
    soft-caps 50 and 30 and window 4096 when absent; Gemma 3's five windowed layers of six (or
    the file's own pattern); Phi-3's window 0 is none; a llama with experts is Mixtral; RoPE
    over part of a head and other architectures refused, named."""

    def fields(arch: str, layers: int = 2, **extra: Any) -> dict[str, Any]:
        return {
            "general.architecture": arch,
            f"{arch}.block_count": layers,
            f"{arch}.embedding_length": 4608,
            f"{arch}.feed_forward_length": 1024,
            f"{arch}.attention.head_count": 32,
            f"{arch}.attention.head_count_kv": 16,
            f"{arch}.attention.key_length": 128,
            f"{arch}.vocab_size": 1000,
            **{f"{arch}.{k}": v for k, v in extra.items()},
        }

    big = model_config_from_gguf(
        fields("gemma2", 46, **{"attention.sliding_window": 4096}), has_output_weight=False
    )
    assert big.query_pre_attn_scalar == 4608 / 32
    small = model_config_from_gguf(fields("gemma2"), has_output_weight=False)
    assert small.query_pre_attn_scalar == 128
    assert (small.attn_logit_softcap, small.final_logit_softcap) == (50.0, 30.0)
    assert small.layer_windows == (4096, None)
    gemma3 = model_config_from_gguf(
        fields("gemma3", 12, **{"attention.sliding_window": 512}), has_output_weight=False
    )
    assert gemma3.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1_000_000.0, 10_000.0)
    own = model_config_from_gguf(
        fields(
            "gemma3",
            3,
            **{
                "attention.sliding_window": 64,
                "attention.sliding_window_pattern": [True, False, True],
            },
        ),
        has_output_weight=False,
    )
    assert own.layer_windows == (64, None, 64)
    phi3 = model_config_from_gguf(
        fields("phi3", **{"attention.sliding_window": 0, "rope.dimension_count": 128}),
        has_output_weight=True,
    )
    assert (phi3.architecture, phi3.sliding_window, phi3.rope_scaling) == ("phi3", None, None)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model_config_from_gguf(
            fields("phi3", **{"rope.dimension_count": 96}), has_output_weight=True
        )
    mixtral = model_config_from_gguf(
        fields("llama", expert_count=8, expert_used_count=2), has_output_weight=True
    )
    assert (mixtral.architecture, mixtral.num_experts, mixtral.norm_topk_prob) == (
        "mixtral",
        8,
        True,
    )
    assert (mixtral.moe_intermediate_size, mixtral.moe_layers) == (1024, (0, 1))
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon'.*gemma2"):
        model_config_from_gguf(fields("falcon"), has_output_weight=True)
    with pytest.raises(ValueError, match="GGUF 'qwen2' with experts"):
        model_config_from_gguf(fields("qwen2", expert_count=4), has_output_weight=True)


def test_names_by_family() -> None:
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma2") == (
        "model.layers.2.pre_feedforward_layernorm.weight"
    )
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "llama") == (
        "model.layers.2.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("blk.0.post_ffw_norm.weight", "gemma3_text") == (
        "model.layers.0.post_feedforward_layernorm.weight"
    )
    assert (
        gguf_to_hf_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"
    )
    assert gguf_to_hf_name("blk.1.attn_qkv.weight", "phi3") == (
        "model.layers.1.self_attn.qkv_proj.weight"
    )
    assert gguf_to_hf_name("rope_factors_long.weight", "phi3") is None
    assert gguf_to_hf_name("blk.4.ffn_down.7.weight", "llama") == (
        "model.layers.4.mlp.experts.7.down_proj.weight"
    )
    with pytest.raises(ValueError, match=r"unknown GGUF tensor 'blk\.0\.attn_qkv\.weight'"):
        gguf_to_hf_name("blk.0.attn_qkv.weight", "llama")
