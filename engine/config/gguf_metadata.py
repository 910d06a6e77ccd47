"""The model's shape from a GGUF file's metadata (`general.architecture` and `<arch>.*` keys),
as llama.cpp reads them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvfleet.engine.config.model import ModelConfig, int_tuple


def model_config_from_gguf(
    fields: Mapping[str, Any],
    has_output_weight: bool,
    rope_factors: Mapping[str, list[float]] | None = None,
) -> ModelConfig:
    """From GGUF key-value metadata (`general.architecture` and `<arch>.*` keys);
    `rope_factors`: Phi-3's LongRoPE factors (the file's rope_factors_long / _short
    tensors). Gemma 2/3 and Phi-3 are read as the config.json llama.cpp's converter wrote
    them from, a llama with experts as Mixtral."""
    arch = str(fields["general.architecture"])
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; kvfleet reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    if arch in ("gemma2", "gemma3", "phi3"):
        hf = _gguf_as_hf_config(arch, fields, has_output_weight, rope_factors or {})
        return ModelConfig.from_hf_config(hf)

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab = key("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
    rope_scaling = _rope_scaling(key)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    layers = int(key("block_count"))
    experts = int(key("expert_count") or 0)
    moe = _experts(arch, key, experts, layers)
    architecture = {"qwen3moe": "qwen3_moe", "llama": "mixtral" if experts else "llama"}
    return ModelConfig(
        architecture=architecture.get(arch, arch),
        vocab_size=int(vocab),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length") or key("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv") or num_heads),
        head_dim=int(key("attention.key_length") or hidden_size // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings=not has_output_weight,
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=int_tuple(eos),
        **moe,
    )


def _rope_scaling(key: Callable[..., Any]) -> dict[str, Any] | None:
    """llama, qwen2, qwen3: linear or YaRN scaling (Llama 3.1's rope_freqs: refused by the
    reader)."""
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    if scaling_type == "yarn":
        original = key("rope.scaling.original_context_length") or key("context_length", 2048)
        return {
            "rope_type": "yarn",
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(original),
        }
    if scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return None


def _experts(arch: str, key: Callable[..., Any], experts: int, layers: int) -> dict[str, Any]:
    """llama.cpp's qwen3moe and llama with experts (Mixtral): experts in every layer, the top k
    renormalized."""
    if not experts:
        return {}
    if arch not in ("qwen3moe", "llama"):
        raise ValueError(
            f"GGUF {arch!r} with experts is not supported; kvfleet reads qwen3moe and llama "
            "(Mixtral)"
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(
            key("expert_feed_forward_length") or key("feed_forward_length")
        ),
        "norm_topk_prob": True,
        "moe_layers": tuple(range(layers)),
    }


GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")
# Gemma's largest models scale the query by (hidden / heads)^-0.5, the rest by head_dim^-0.5;
# GGUF does not store the scalar, so llama.cpp tells them by their layer count (as here)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_as_hf_config(
    arch: str,
    fields: Mapping[str, Any],
    has_output_weight: bool,
    rope_factors: Mapping[str, list[float]],
) -> dict[str, Any]:
    """The config.json (transformers 4 layout) a Gemma 2/3 or Phi-3 GGUF file was converted
    from, as far as its metadata and llama.cpp's fixed choices tell it."""

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length") or hidden // heads)
    layers = int(key("block_count"))
    config: dict[str, Any] = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": int(key("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    window = int(key("attention.sliding_window") or 0)
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim  # (refused, named)
    if arch == "phi3":
        config["rope_theta"] = float(key("rope.freq_base", 10000.0))
        config["sliding_window"] = window or None  # (0: none, as llama.cpp writes Phi-4)
        original = key("rope.scaling.original_context_length")
        config["original_max_position_embeddings"] = int(
            original or config["max_position_embeddings"]
        )
        if rope_factors:
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": list(rope_factors["long"]),
                "short_factor": list(rope_factors["short"]),
            }
            if key("rope.scaling.attn_factor") is not None:
                config["rope_scaling"]["attention_factor"] = float(key("rope.scaling.attn_factor"))
        return config
    large = layers == _GEMMA_27B_LAYERS[arch]
    config["query_pre_attn_scalar"] = hidden // heads if large else head_dim
    config["sliding_window"] = window
    if arch == "gemma2":  # (llama.cpp's defaults where the file is silent)
        config["rope_theta"] = float(key("rope.freq_base", 10000.0))
        config["sliding_window"] = window or 4096
        config["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
        return config
    # Gemma 3: the base and scaling of the global layers; the windowed ones turn at 10,000
    # unscaled; five windowed layers of every six unless the file says otherwise
    config["rope_theta"] = float(key("rope.freq_base", 1_000_000.0))
    config["rope_local_base_freq"] = 10_000.0
    if key("rope.scaling.type") not in (None, "none"):
        if key("rope.scaling.type") != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {key('rope.scaling.type')!r}")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(key("rope.scaling.factor")),
        }
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list | tuple):
        config["layer_types"] = [
            "sliding_attention" if windowed else "full_attention" for windowed in pattern
        ]
    else:
        config["sliding_window_pattern"] = int(pattern)
    return config
