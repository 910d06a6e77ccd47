"""The model's shape (`ModelConfig`), read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    quantization_config: Mapping[str, Any] | None = None  # config.json's, as written

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; kvfleet serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {ROPE_TYPES}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4.x or 5.x layout)."""
        model_type = str(config.get("model_type", ""))
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        rope_theta, rope_scaling = _hf_rope(config)
        if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn":
            # (as transformers reads it: the original context defaults to the model's, the
            # factor to the ratio of the two)
            original = rope_scaling.get("original_max_position_embeddings")
            original = int(original or config.get("max_position_embeddings", 2048))
            factor = rope_scaling.get("factor") or int(config["max_position_embeddings"]) / original
            rope_scaling = {
                **rope_scaling,
                "original_max_position_embeddings": original,
                "factor": factor,
            }
        is_qwen2 = model_type == "qwen2"
        sliding_window = _one_window(config, model_type)
        eos = config.get("eos_token_id")
        return cls(
            architecture=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(config.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_int_tuple(eos),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            quantization_config=config.get("quantization_config"),
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key-value metadata (`general.architecture` and `<arch>.*` keys)."""
        arch = str(fields["general.architecture"])
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; kvfleet reads llama, qwen2, qwen3"
            )

        def key(name: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{name}", default)

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        vocab = key("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        scaling_type = key("rope.scaling.type")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type == "yarn":
            rope_scaling = {
                "rope_type": "yarn",
                "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": int(
                    key("rope.scaling.original_context_length") or key("context_length", 2048)
                ),
            }
        elif scaling_type not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv") or num_heads),
            head_dim=int(key("attention.key_length") or hidden_size // num_heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_int_tuple(eos),
        )


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (transformers 4), with the scaling type under `rope_type`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **merged}


def _one_window(config: Mapping[str, Any], model_type: str) -> int | None:
    """The sliding window every layer uses, or None. Qwen2/Qwen3 window only the layers from
    `max_window_layers` on, and only with `use_sliding_window` (transformers' `layer_types`);
    a model mixing windowed and full layers is refused (one window per model here)."""
    window = config.get("sliding_window")
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None and model_type in ("qwen2", "qwen3"):
        windowed = bool(config.get("use_sliding_window", False) and window)
        first = int(config.get("max_window_layers", layers)) if windowed else layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return int(window) if window else None
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window:
        return int(window)
    raise ValueError(
        f"layer_types {sorted(kinds)} (sliding-window and full-attention layers mixed, or a "
        "window without its size) are not supported yet: kvfleet runs one attention kind for "
        "every layer"
    )


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
