"""bench/quality.py's two perplexities agree where the kernels are exact: a random tiny Llama in
float32 on the CPU (the torch attention backend), the text as one prompt forward and fed a token
a step as decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvfleet.bench.quality import decode_perplexity, perplexity  # noqa: E402
from kvfleet.engine.llm import LLM  # noqa: E402


def test_the_decode_steps_perplexity_is_the_prompt_forwards(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_blocks=32,
              max_model_len=128)  # fmt: skip
    model, device = llm.engine.runner.model, llm.engine.device
    text = [int(t) for t in torch.randint(0, 256, (70,))]  # (past four blocks of 16)
    whole = perplexity(model, text, device)
    stepped = decode_perplexity(model, text, device)
    assert 1.0 < whole < 1e4
    assert stepped == pytest.approx(whole, rel=1e-5)
    assert decode_perplexity(model, text[:40] + text[41:], device) != pytest.approx(stepped)
    llm.engine.close()
