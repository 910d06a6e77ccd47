"""Our engine's log-probabilities against transformers on small random Llama-family models.

Tolerance (float32 on CPU): every reported top-20 logprob within 1e-5 of transformers' at the
same position, over a prompt computed in chunks and 16 decoded tokens, then over a second
request whose first 64 tokens are read from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

TOLERANCE = 1e-5


def test_logprobs_match_transformers(
    hf_config_name: str,
    hf_model_dir: Callable[[str], tuple[Any, Path]],
    logprob_gap: Callable[..., float],
) -> None:
    hf_model, folder = hf_model_dir(hf_config_name)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 384, (70,), generator=generator).tolist()
    llm = LLM(
        str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=8,
        max_num_batched_tokens=32,  # the 70-token prompt runs in 3 chunks
        num_blocks=64,
        max_model_len=256,
    )
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=20, ignore_eos=True)
    (output,) = llm.generate(prompt, params)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 16

    worst = logprob_gap(hf_model, prompt, completion)
    assert worst < TOLERANCE, f"max |logprob difference| {worst:.2e}"
    # a second request on the first one's 64-token prefix: read from the cache, same bar
    second = prompt[:64] + torch.randint(3, 384, (6,), generator=generator).tolist()
    (output,) = llm.generate(second, params)
    assert output.num_cached_tokens == 64
    worst = logprob_gap(hf_model, second, output.outputs[0])
    assert worst < TOLERANCE, f"after a prefix hit: max |logprob difference| {worst:.2e}"


def test_checkpoint_shapes_list_what_transformers_saves(
    hf_config_name: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    """The tensors a dummy load draws (`checkpoint_shapes`) are exactly a real checkpoint's."""
    import json

    from kvfleet.engine.config import ModelConfig
    from kvfleet.engine.loader.model_loader import checkpoint_shapes

    hf_model, folder = hf_model_dir(hf_config_name)
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    saved = {
        name: tuple(tensor.shape)
        for name, tensor in hf_model.state_dict().items()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
    }
    assert dict(checkpoint_shapes(config)) == saved


def test_what_a_config_asks_for_is_served_or_refused_by_name() -> None:
    """Qwen3's flags; YaRN's defaults as transformers fills them (the original context from the
    model's, the factor from the ratio), from config.json and GGUF; which layers a sliding
    window covers; an architecture, RoPE type or mix of layer kinds kvfleet does not implement
    is refused naming what is supported."""
    import pytest

    from kvfleet.engine.config import ModelConfig

    base = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
    }
    yarn = {"rope_type": "yarn", "factor": 4.0}
    qwen3 = ModelConfig.from_hf_config(
        {
            **base,
            "model_type": "qwen3",
            "head_dim": 32,
            "sliding_window": 4096,
            "rope_scaling": yarn,
        }
    )
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.sliding_window, qwen3.head_dim) == (
        True,
        False,
        None,
        32,
    )
    assert qwen3.rope_scaling == {**yarn, "original_max_position_embeddings": 4096}
    ratio = {"rope_type": "yarn", "original_max_position_embeddings": 1024}
    implied = ModelConfig.from_hf_config({**base, "model_type": "qwen3", "rope_scaling": ratio})
    assert (implied.rope_scaling or {})["factor"] == 4.0
    fields = {
        "general.architecture": "qwen3",
        "qwen3.embedding_length": 64,
        "qwen3.attention.head_count": 4,
        "qwen3.feed_forward_length": 128,
        "qwen3.block_count": 1,
        "qwen3.vocab_size": 64,
        "qwen3.context_length": 4096,
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 1024,
    }
    gguf = ModelConfig.from_gguf_fields(fields, has_output_weight=True)
    assert gguf.qk_norm
    assert gguf.rope_scaling == {**yarn, "original_max_position_embeddings": 1024}
    # sliding windows: Qwen's from max_window_layers on, with use_sliding_window; Mistral's all
    windowed = {**base, "model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 64}
    on = {**windowed, "use_sliding_window": True}
    assert ModelConfig.from_hf_config(windowed).sliding_window is None
    assert ModelConfig.from_hf_config({**on, "max_window_layers": 0}).sliding_window == 64
    assert ModelConfig.from_hf_config({**on, "max_window_layers": 2}).sliding_window is None
    with pytest.raises(ValueError, match="sliding-window and full-attention layers mixed"):
        ModelConfig.from_hf_config({**on, "max_window_layers": 1})
    mistral = {**base, "model_type": "mistral", "sliding_window": 64}
    assert ModelConfig.from_hf_config(mistral).sliding_window == 64
    mixed = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="not supported yet"):
        ModelConfig.from_hf_config({**mistral, "num_hidden_layers": 2, "layer_types": mixed})
    with pytest.raises(ValueError, match="unsupported architecture 'gemma2'; kvfleet serves llama"):
        ModelConfig.from_hf_config({**base, "model_type": "gemma2"})
    with pytest.raises(ValueError, match=r"unsupported rope scaling 'longrope'.*'yarn'"):
        ModelConfig.from_hf_config(
            {**base, "model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}
        )
