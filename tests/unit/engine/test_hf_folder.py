"""Hugging Face folders: sharded safetensors with an index, and a tokenizer with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.tokenizer import Tokenizer


def test_sharded_checkpoint_loads_every_shard(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3

    llm = LLM(
        str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_blocks=32, max_model_len=128
    )
    prompt = list(range(5, 40))
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            min_new_tokens=6,
            pad_token_id=0,
        )
    assert out.outputs[0].token_ids == reference[0, len(prompt) :].tolist()

    (tmp_path / index["weight_map"]["model.norm.weight"]).unlink()
    with pytest.raises(ValueError, match="safetensors files missing"):
        LLM(
            str(tmp_path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_blocks=32,
            max_model_len=128,
        )


def test_tokenizer_and_chat_template_from_a_folder(tmp_path: Path) -> None:
    """A random model with SmolLM2's vocabulary, saved with SmolLM2's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    smollm2 = Tokenizer.load(resolve_model_source("smollm2"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=smollm2.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm2.hf.save_pretrained(tmp_path)

    llm = LLM(str(tmp_path), dtype="float32", num_blocks=32, max_model_len=256)
    assert llm.engine.source.format == "hf"
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        }
    ]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    expected = smollm2.encode(
        smollm2.apply_chat_template([{"role": "user", "content": "Hi there"}]),
        add_special_tokens=False,
    )
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="unknown chat role 'wizard'"):
        llm.chat([{"role": "wizard", "content": "x"}])


def test_shipped_configs_resolve_for_dummy_loads() -> None:
    from kvfleet.engine.loader.source import builtin_configs

    assert builtin_configs() == [
        "gemma-3-12b", "llama-3-70b", "llama-3-8b", "llama-3.2-1b", "mixtral-8x7b",
        "phi-3-mini", "qwen2.5-7b", "qwen3-30b-a3b", "qwen3-8b",
    ]  # fmt: skip
    config = resolve_model_source("llama-3-8b", "dummy").read_config()
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (4096, 8, 128)
    assert (config.rope_scaling or {})["rope_type"] == "llama3"
    assert resolve_model_source("qwen2.5-7b", "dummy").read_config().qkv_bias
    qwen3 = resolve_model_source("qwen3-8b", "dummy").read_config()
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.sliding_window, qwen3.head_dim) == (
        True, False, None, 128,
    )  # fmt: skip
    moe = resolve_model_source("qwen3-30b-a3b", "dummy").read_config()
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert (moe.norm_topk_prob, moe.qk_norm, moe.moe_layers) == (True, True, tuple(range(48)))
    mixtral = resolve_model_source("mixtral-8x7b", "dummy").read_config()
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (14336, True)
    assert mixtral.moe_layers == tuple(range(32))
    gemma = resolve_model_source("gemma-3-12b", "dummy").read_config()
    assert gemma.layer_windows == ((1024,) * 5 + (None,)) * 8
    assert (gemma.rope_scaling, gemma.local_rope_theta) == (
        {"rope_type": "linear", "factor": 8.0}, 10000.0,
    )  # fmt: skip
    phi = resolve_model_source("phi-3-mini", "dummy").read_config()
    assert (phi.head_dim, phi.sliding_window, phi.rope_scaling) == (96, 2047, None)
    with pytest.raises(ValueError, match=r"or a shipped config \(gemma-3-12b, llama-3-70b"):
        resolve_model_source("llama-9-1t", "dummy")
