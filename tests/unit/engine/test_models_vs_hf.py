"""Our engine's log-probabilities against transformers on small random Llama-family models.

Tolerance (float32 on CPU): every reported top-20 logprob within 1e-5 of transformers' at the
same position, over a prompt computed in chunks and 16 decoded tokens, then over a second
request whose first 64 tokens are read from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.config.gguf_metadata import model_config_from_gguf
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


@pytest.mark.parametrize(
    "family",
    ["mixtral-moe", "qwen3-moe-dense-layer", "gemma2-softcap-windows", "gemma3-local-global",
     "phi3-longrope"],
)  # fmt: skip
def test_the_families_keep_their_output_through_preemption(
    family: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    """Five requests (their ends unknown: EOS may stop them) in a pool with room for two: each
    is preempted and recomputed at least once overall, and every output is the one it has in a
    roomy pool (windowed layers, experts and Phi-3's rotation recomputed alike)."""
    _, folder = hf_model_dir(family)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (30 + 7 * i,), generator=generator).tolist() for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40)
    outputs = {}
    for num_blocks in (64, 17):  # (blocks of 8: 16 usable hold two of them to their ends)
        llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, block_size=8,
                  num_blocks=num_blocks, max_model_len=128, max_num_batched_tokens=64)  # fmt: skip
        outputs[num_blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        preemptions = llm.engine.scheduler.num_preemptions
        assert (preemptions > 0) == (num_blocks == 17), preemptions
    assert outputs[17] == outputs[64]
    assert all(len(tokens) > 16 for tokens in outputs[64])  # (long enough to need the room)


def test_checkpoint_shapes_list_what_transformers_saves(
    hf_config_name: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    """The tensors a dummy load draws (`checkpoint_shapes`) are exactly the ones transformers
    writes (for a mixture of experts: one tensor per expert projection, as published, not the
    stacked parameters it holds in memory)."""
    import json

    from safetensors import safe_open

    from kvfleet.engine.config import ModelConfig
    from kvfleet.engine.loader.model_loader import checkpoint_shapes

    _, folder = hf_model_dir(hf_config_name)
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    saved = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as file:
            names = list(file.keys())
            saved.update({name: tuple(file.get_slice(name).get_shape()) for name in names})
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
    gguf = model_config_from_gguf(fields, has_output_weight=True)
    assert gguf.qk_norm
    assert gguf.rope_scaling == {**yarn, "original_max_position_embeddings": 1024}
    # sliding windows: Qwen's from max_window_layers on, with use_sliding_window; Mistral's all
    windowed = {**base, "model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 64}
    on = {**windowed, "use_sliding_window": True}
    assert ModelConfig.from_hf_config(windowed).sliding_window is None
    assert ModelConfig.from_hf_config({**on, "max_window_layers": 0}).sliding_window == 64
    assert ModelConfig.from_hf_config({**on, "max_window_layers": 2}).sliding_window is None
    assert ModelConfig.from_hf_config({**on, "max_window_layers": 1}).layer_windows == (None, 64)
    mistral = {**base, "model_type": "mistral", "sliding_window": 64}
    assert ModelConfig.from_hf_config(mistral).sliding_window == 64
    mixed = ["sliding_attention", "full_attention"]
    two = {**mistral, "num_hidden_layers": 2, "layer_types": mixed}
    assert ModelConfig.from_hf_config(two).layer_windows == (64, None)
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]"):
        ModelConfig.from_hf_config({**two, "layer_types": ["chunked_attention"] * 2})
    # Gemma: every other layer windowed (2), five of six (3, `sliding_window_pattern`)
    gemma = {**base, "num_hidden_layers": 6, "sliding_window": 32, "head_dim": 16}
    gemma2 = ModelConfig.from_hf_config({**gemma, "model_type": "gemma2"})
    assert gemma2.layer_windows == (32, None) * 3
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (None, None)
    gemma3 = ModelConfig.from_hf_config(
        {**gemma, "model_type": "gemma3_text", "rope_local_base_freq": 5000.0}
    )
    assert gemma3.layer_windows == (32, 32, 32, 32, 32, None)
    assert (gemma3.local_rope_theta, gemma3.rope_theta, gemma3.qk_norm) == (5000.0, 1e6, True)
    assert (gemma3.mlp_activation, gemma3.embedding_multiplier) == ("gelu_tanh", 8.0)
    with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
        ModelConfig.from_hf_config(
            {**gemma, "model_type": "gemma3_text", "use_bidirectional_attention": True}
        )
    with pytest.raises(ValueError, match="unsupported architecture 'gemma3'; kvfleet serves"):
        ModelConfig.from_hf_config({**base, "model_type": "gemma3"})
    with pytest.raises(ValueError, match=r"unsupported rope scaling 'dynamic'.*'longrope'"):
        ModelConfig.from_hf_config(
            {**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}}
        )
    with pytest.raises(ValueError, match="'longrope' is supported for phi3 only"):
        ModelConfig.from_hf_config(
            {**base, "model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}
        )


def test_which_layers_hold_experts_and_what_is_refused() -> None:
    """Qwen3-MoE's expert layers as transformers picks them (`mlp_only_layers`,
    `decoder_sparse_step`), its router renormalizing only with `norm_topk_prob` (default off),
    Mixtral's always; a top k above the expert count, or experts too narrow to split over the
    ranks, refused before anything loads."""
    import pytest

    from kvfleet.engine.config import ModelConfig
    from kvfleet.engine.parallel.partition import TPPlan

    base = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
    }
    qwen = {**base, "model_type": "qwen3_moe"}
    every_other = ModelConfig.from_hf_config({**qwen, "decoder_sparse_step": 2})
    assert every_other.moe_layers == (1, 3, 5)
    assert not every_other.norm_topk_prob
    some_dense = {**qwen, "mlp_only_layers": [0, 4], "norm_topk_prob": True}
    assert ModelConfig.from_hf_config(some_dense).moe_layers == (1, 2, 3, 5)
    assert ModelConfig.from_hf_config(some_dense).norm_topk_prob
    assert ModelConfig.from_hf_config({**qwen, "num_experts": 0}).moe_layers == ()
    mixtral = ModelConfig.from_hf_config(
        {**base, "model_type": "mixtral", "num_local_experts": 8, "norm_topk_prob": False}
    )
    assert (mixtral.moe_layers, mixtral.norm_topk_prob) == (tuple(range(6)), True)
    assert mixtral.moe_intermediate_size == 128
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and"):
        ModelConfig.from_hf_config({**qwen, "num_experts_per_tok": 9})
    config = ModelConfig.from_hf_config(qwen)
    assert TPPlan.build(config, 1, 4).local_config(config).moe_intermediate_size == 1
    with pytest.raises(ValueError, match=r"the experts' inner dimension \(4\) cannot be split"):
        TPPlan.build(config, 0, 8)


def test_phi3_longrope_reads_as_transformers_and_is_fixed_per_engine() -> None:
    """Phi-3's "su" (and "yarn") scaling is LongRoPE, its original context read from the top
    level, its factor the ratio of the contexts; an engine serving past the original context
    rotates with the long factors, one within it with the short ones, scaled alike by
    sqrt(1 + ln(factor) / ln(original)). RoPE over part of a head, or another activation,
    refused by name."""
    import math

    import pytest

    from kvfleet.engine.config import ModelConfig
    from kvfleet.engine.layers.torch_layers import rope_attention_factor, rope_inv_freq

    short, long = [1.0] * 8, [4.0] * 8
    phi3 = {
        "model_type": "phi3",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 8192,
        "original_max_position_embeddings": 2048,
        "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
    }
    config = ModelConfig.from_hf_config(phi3)
    scaling = config.rope_scaling or {}
    assert (scaling["rope_type"], scaling["factor"]) == ("longrope", 4.0)
    assert scaling["original_max_position_embeddings"] == 2048
    within, past = config.with_context(2048), config.with_context(2049)
    plain = rope_inv_freq(16, 10000.0, None)
    assert torch.allclose(rope_inv_freq(16, 10000.0, within.rope_scaling), plain)
    assert torch.allclose(rope_inv_freq(16, 10000.0, past.rope_scaling), plain / 4)
    assert rope_attention_factor(past.rope_scaling) == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(2048))
    )
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.75"):
        ModelConfig.from_hf_config({**phi3, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported for 'phi3'"):
        ModelConfig.from_hf_config({**phi3, "hidden_act": "gelu"})
