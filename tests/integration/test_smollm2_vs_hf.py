"""SmolLM2 (the Q4_1 GGUF) through our engine against transformers loading the same file.

Greedy, float32, CPU: token for token, 8 varied prompts x 64 new tokens run as ONE concurrent
batch under a 64-token step budget, so long prompts are prefilled in chunks while others decode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.loader import model_cache
from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(900)

LONG_DOCUMENT = " ".join(
    f"Section {i}: the harbor city kept its lighthouse lit for {i * 3} nights while ships waited."
    for i in range(1, 16)
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": f"Summarize this text:\n{LONG_DOCUMENT}"}],
    [
        {"role": "user", "content": "Write a haiku about GPUs."},
        {"role": "assistant", "content": "Silicon rivers / warm arithmetic / night hums"},
        {"role": "user", "content": "Now one about caches."},
    ],
]
TEXTS = [
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Once upon a time, in a village at the edge of a forest, there lived",
    "1, 2, 3, 5, 8, 13,",
]
NEW_TOKENS = 64
BUDGET = 64


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    cached, _ = model_cache.ModelCache(model_cache.kvfleet_home()).fetch(
        model_cache.BUILTIN_MODELS["smollm2"], progress=False
    )
    return cached.path


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def prompts(hf: tuple[Any, Any]) -> list[list[int]]:
    tokenizer, _ = hf
    chats = [
        tokenizer.encode(
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for c in CHATS
    ]
    return chats + [tokenizer.encode(t) for t in TEXTS]


def test_our_tokenizer_matches_transformers(hf: tuple[Any, Any]) -> None:
    tokenizer, _ = hf
    engine_tokenizer = Tokenizer.load(resolve_model_source("smollm2"))
    for chat in CHATS:
        ours = engine_tokenizer.apply_chat_template(chat)
        assert ours == tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        assert engine_tokenizer.encode(ours, add_special_tokens=False) == tokenizer.encode(
            ours, add_special_tokens=False
        )
    for text in [*TEXTS, "héllo wörld — ünïcödé 你好 🤖"]:
        assert engine_tokenizer.encode(text) == tokenizer.encode(text)


def test_greedy_matches_transformers_in_one_chunked_batch(
    hf: tuple[Any, Any], prompts: list[list[int]], hf_greedy: Callable[..., list[int]]
) -> None:
    tokenizer, model = hf
    assert max(len(p) for p in prompts) > 3 * BUDGET  # a prompt needs several chunks
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    engine = LLMEngine(
        EngineConfig(
            model="smollm2",
            dtype="float32",
            max_model_len=1024,
            scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET),
            cache=CacheConfig(num_blocks=512),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    max_running = 0
    mixed_steps = 0  # steps where a prompt chunk ran beside decoding requests
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        max_running = max(max_running, engine.scheduler.num_running)
        decoding = [rid for rid, n in before.items() if n >= len(prompts[int(rid[1:])])]
        prefilling = [rid for rid, n in before.items() if n < len(prompts[int(rid[1:])])]
        mixed_steps += bool(decoding and prefilling)
    assert len(outputs) == len(prompts)
    assert max_running == len(prompts)  # all eight ran concurrently
    assert mixed_steps > 0

    for i, prompt in enumerate(prompts):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        ours = outputs[f"r{i}"].outputs[0]
        assert ours.token_ids == reference, f"prompt {i} diverges"
        assert ours.text == tokenizer.decode(reference, skip_special_tokens=True)
    assert engine.kv_cache_manager.usage == 0.0
