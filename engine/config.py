"""Engine configuration: the model's shape, the KV cache, the scheduler, the engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


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
    mlp_bias: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

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
        is_qwen2 = model_type == "qwen2"
        sliding_window = config.get("sliding_window")
        if is_qwen2 and not config.get("use_sliding_window", False):
            sliding_window = None
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
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_int_tuple(eos),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key-value metadata (`general.architecture` and `<arch>.*` keys)."""
        arch = str(fields["general.architecture"])
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}; kvfleet reads llama, qwen2")

        def key(name: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{name}", default)

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        vocab = key("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        scaling_type = key("rope.scaling.type")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
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


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `num_blocks` fixes its size; otherwise it is sized from memory: a
    fraction of the GPU's (`gpu_memory_utilization`), or `cpu_kv_cache_gib` on the CPU."""

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # At most this many requests compute prompt tokens in one step: a burst is prefilled a
    # slice at a time, so the first to arrive decode within a few steps (first come, first
    # served) instead of all waiting for every prompt.
    max_prefill_seqs: int = 32
    enable_chunked_prefill: bool = True
    # Schedule and prepare step N+1 while step N runs on the device (steps whose requests use
    # penalties, which read every output token, still run one at a time).
    async_scheduling: bool = True


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA: `max_loras` adapters in device slots at once (and per step), up to
    `max_cpu_loras` kept in host memory, ranks up to `max_lora_rank`; `lora_modules` maps
    names to PEFT folders loaded at start."""

    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None  # default: max_loras
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}) must be "
                "at least 1"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as `--speculative-config '{"method": "ngram",
    "num_speculative_tokens": 4}'` gives it: drafts by prompt lookup (`ngram`: the tokens that
    followed the latest earlier occurrence of the request's last `prompt_lookup_min` to
    `prompt_lookup_max` tokens) or by a smaller model of the same tokenizer (`draft`, `model`),
    up to `num_speculative_tokens` per request and step, verified by the target in one forward.
    With `adaptive`, fewer drafts (down to none) where the batch's size and acceptance say they
    would cost more than they save."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                "num_speculative_tokens must be between 1 and 16, got "
                f"{self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.method == "draft") != (self.model is not None):
            raise ValueError(
                'the "draft" method needs a draft "model" (a smaller model with the same '
                'tokenizer); "ngram" takes none'
            )

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SpeculativeConfig:
        """From the JSON object (or the mapping) a user gives; ValueError naming what is
        wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError("the speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"the speculative config needs {name!r}")
        types = {"method": str, "model": str, "adaptive": bool}
        for name, item in value.items():
            want = types.get(name, int)
            if name == "model" and item is None:
                continue
            if not isinstance(item, want) or (want is int and isinstance(item, bool)):
                raise ValueError(f"speculative config {name!r} must be {want.__name__}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `kvfleet engine` accept. `model` is an alias (`smollm2`), a
    GGUF file, a Hugging Face folder, a hub id, or a config (.json) with `load_format="dummy"`."""

    model: str
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # token ids in and out only
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    attention_backend: str = "auto"  # triton on CUDA, torch elsewhere; or "torch", "triton"
    enable_kv_events: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    tensor_parallel_size: int = 1  # processes (GPUs) one model is split across
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.lora.enable_lora:
            raise ValueError("LoRA adapters are not available with tensor parallelism yet")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
