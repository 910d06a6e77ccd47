"""The engine's settings: the KV cache, the scheduler, LoRA, speculative decoding, and the
engine itself. Each field carries its command-line name and help (`setting`), from which the
`kvfleet engine` flags, `LLM(**kwargs)` and the operator's engine arguments are derived
(config/settings.py): a new setting is added here, once."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvfleet.engine.config.settings import Setting, setting, settings_of, split_kwargs
from kvfleet.engine.layers.quantization.scheme import QUANTIZATION_METHODS
from kvfleet.engine.protocol.openai import LoadLoRAAdapterRequest

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `num_blocks` fixes its size; otherwise it is sized from memory: a
    fraction of the GPU's (`gpu_memory_utilization`), or `cpu_kv_cache_gib` on the CPU."""

    block_size: int = field(default=16, metadata=setting("tokens per KV-cache block"))
    num_blocks: int | None = field(
        default=None, metadata=setting("KV-cache blocks (default: sized from memory)")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=setting("the fraction of GPU memory the engine may use")
    )
    cpu_kv_cache_gib: float = field(
        default=2.0, metadata=setting("the KV cache's size on the CPU, in GiB")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=setting("reuse the KV blocks of prompts' common prefixes")
    )
    swap_space_gib: float = field(
        default=4.0,
        metadata=setting(
            "host memory, in GiB, for preempted requests' KV blocks: swapped out there and "
            "copied back when they resume instead of recomputed (pinned on a GPU; at most as "
            "many blocks as the KV cache; 0: always recompute; not used with tensor "
            "parallelism or speculative decoding)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=setting(
            "auto: the model's dtype; fp8 (= fp8_e4m3): K and V stored as e4m3 with a scale per "
            "layer (the checkpoint's, else 1.0), twice the tokens in the same memory",
            choices=KV_CACHE_DTYPES,
        ),
    )
    calculate_kv_scales: bool = field(
        default=False,
        metadata=setting(
            "an FP8 KV cache without scales in the checkpoint: each layer's K and V scales "
            "from the first prompt served (its largest magnitude over 224: 2x headroom) "
            "instead of 1.0"
        ),
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.swap_space_gib < float("inf"):  # (NaN fails too)
            raise ValueError(
                f"swap_space_gib must be a finite number of GiB, 0 or more, got "
                f"{self.swap_space_gib}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an FP8 KV cache (kv_cache_dtype fp8)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = field(
        default=2048, metadata=setting("tokens computed in one step at most (the step budget)")
    )
    max_num_seqs: int = field(default=256, metadata=setting("requests running at once at most"))
    # (a burst is prefilled a slice at a time, so the first to arrive decode within a few
    # steps, first come first served, instead of all waiting for every prompt)
    max_prefill_seqs: int = field(
        default=32,
        metadata=setting(
            "at most this many requests compute prompt tokens in one step (bursts are served "
            "first come, a slice at a time)"
        ),
    )
    # (a request arriving during a long prefill starts at the next step instead of after it)
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=setting(
            "while requests wait to start, a prompt computes at most this many tokens a step "
            "(default: half of max_num_batched_tokens; 0: no cap)"
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=setting("split long prompts over steps beside running decodes")
    )
    # (steps whose requests use penalties, which read every output token, still run one at a
    # time)
    async_scheduling: bool = field(
        default=True,
        metadata=setting("schedule and prepare step N+1 while step N runs on the device"),
    )

    def __post_init__(self) -> None:
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or more, got {threshold}"
            )

    @property
    def prefill_chunk_cap(self) -> int | None:
        """The cap on a prompt's tokens a step while requests wait to start (None: none)."""
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            return max(1, self.max_num_batched_tokens // 2)
        return threshold or None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA: `max_loras` adapters in device slots at once (and per step), up to
    `max_cpu_loras` kept in host memory, ranks up to `max_lora_rank`; `lora_modules` maps
    names to PEFT folders loaded at start."""

    enable_lora: bool = field(default=False, metadata=setting("serve LoRA adapters"))
    max_loras: int = field(default=4, metadata=setting("adapters in GPU slots at once"))
    max_cpu_loras: int | None = field(
        default=None, metadata=setting("adapters kept in host memory (default: max_loras)")
    )
    max_lora_rank: int = field(default=16, metadata=setting("the largest adapter rank"))
    # ({name: folder} or (name, folder) pairs; NAME=PATH on the command line)
    lora_modules: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=setting(
            "PEFT adapter folders to load at start",
            metavar="NAME=PATH",
            parse=lambda items: tuple(LoadLoRAAdapterRequest.parse_flag(items, "--lora-modules")),
        ),
    )

    def __post_init__(self) -> None:
        modules = self.lora_modules
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in pairs))
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


def _speculative_flag(config: SpeculativeConfig) -> list[str]:
    given = {key: value for key, value in asdict(config).items() if value is not None}
    return [json.dumps(given, separators=(",", ":"))]


# Above this the host's launches are a small part of a step's time, and the static buffers large.
MAX_PREFILL_GRAPH_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `kvfleet engine` accept. `model` is an alias (`smollm2`), a
    GGUF file, a Hugging Face folder, a hub id, or a config (.json) with `load_format="dummy"`."""

    model: str
    load_format: str = field(
        default="auto",
        metadata=setting("how to read the model (dummy: random weights)", choices=LOAD_FORMATS),
    )
    dtype: str = field(default="auto", metadata=setting("weights' dtype", choices=DTYPES))
    quantization: str | None = field(
        default=None,
        metadata=setting(
            "fp8: a bf16/fp16 checkpoint's linear layers quantized at load (FP8 weights and "
            "activations; needs a GPU of compute capability 8.9+); rtn: INT4 weights rounded "
            "at load; gguf: a GGUF file's Q4_0/Q4_1/Q4_K layers kept 4-bit; awq, gptq: must agree "
            "with the checkpoint; default: the checkpoint's own quantization_config, if any "
            "(compressed-tensors FP8, fp8 block, AWQ, GPTQ)",
            choices=QUANTIZATION_METHODS,
        ),
    )
    device: str = field(default="auto", metadata=setting("auto (CUDA when present), cpu, cuda"))
    seed: int = field(default=0, metadata=setting("the seed of unseeded requests' sampling"))
    tokenizer: str | None = field(
        default=None, metadata=setting("a tokenizer folder or hub id other than the model's")
    )
    skip_tokenizer_init: bool = field(
        default=False, metadata=setting("token ids in and out only", command_line=False)
    )
    max_model_len: int | None = field(
        default=None, metadata=setting("tokens a sequence may hold (default: the model's)")
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enforce_eager: bool = field(default=False, metadata=setting("no CUDA graphs"))
    prefill_graph_tokens: int = field(
        default=512,
        metadata=setting(
            "steps holding prompt tokens, up to this many tokens, replay CUDA graphs in pieces "
            "around attention (0: such steps run eagerly)"
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=setting("auto: triton on CUDA, torch elsewhere", choices=ATTENTION_BACKENDS),
    )
    enable_kv_events: bool = field(
        default=False, metadata=setting("record prefix-cache events", command_line=False)
    )
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    tensor_parallel_size: int = field(
        default=1, metadata=setting("GPUs (or, on the CPU, processes) one model is split across")
    )
    speculative: SpeculativeConfig | None = field(
        default=None,
        metadata=setting(
            'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": true}',
            kwarg="speculative_config",
            metavar="JSON",
            parse=SpeculativeConfig.parse,
            render=_speculative_flag,
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative, Mapping):  # (as `LLM(speculative_config={...})`)
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"unknown quantization method {self.quantization!r}; supported: "
                f"{', '.join(QUANTIZATION_METHODS)}"
            )
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
        if not 0 <= self.prefill_graph_tokens <= MAX_PREFILL_GRAPH_TOKENS:
            raise ValueError(
                f"prefill_graph_tokens must be between 0 and {MAX_PREFILL_GRAPH_TOKENS}, "
                f"got {self.prefill_graph_tokens}"
            )

    @classmethod
    def from_kwargs(
        cls, model: str, kwargs: Mapping[str, Any], flag_names: bool = False
    ) -> EngineConfig:
        """From flat settings by keyword (`LLM(model, **kwargs)`, or the parsed flags of
        `kvfleet engine`, whose errors then name the flags); TypeError for an unknown keyword,
        ValueError for a bad value."""
        top, sections = split_kwargs(engine_settings(), kwargs, flag_names)
        return cls(
            model=model,
            cache=CacheConfig(**sections.get("cache", {})),
            scheduler=SchedulerConfig(**sections.get("scheduler", {})),
            lora=LoRAConfig(**sections.get("lora", {})),
            **top,
        )


@functools.cache
def engine_settings() -> tuple[Setting, ...]:
    """Every engine setting (EngineConfig's and its sections'), in declaration order."""
    return tuple(settings_of(EngineConfig, sections=("cache", "scheduler", "lora")))
