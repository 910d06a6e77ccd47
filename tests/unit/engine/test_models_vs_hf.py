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
