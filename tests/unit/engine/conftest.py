"""Small random Hugging Face models saved as real folders, for engine tests against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope-untied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama2-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2-qkv-bias": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "mistral-sliding-window": (
        "MistralConfig",
        {"tie_word_embeddings": False, "sliding_window": 24, "num_key_value_heads": 1},
    ),
}


def build_hf_model(name: str, seed: int = 0) -> Any:
    """A random transformers model for CONFIGS[name], float32, biases random too."""
    class_name, extra = CONFIGS[name]
    config = getattr(transformers, class_name)(**{**BASE, **extra})
    config._attn_implementation = "eager" if "sliding" in name else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias") or param_name.endswith("norm.weight"):
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """`hf_model_dir(name)` -> (the transformers model, the folder it was saved to)."""
    made: dict[str, tuple[Any, Path]] = {}

    def hf_model_dir(name: str) -> tuple[Any, Path]:
        if name not in made:
            model = build_hf_model(name)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            made[name] = (model, folder)
        return made[name]

    return hf_model_dir
