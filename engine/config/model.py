"""The model's shape (`ModelConfig`), read from a Hugging Face config.json (GGUF metadata:
gguf_metadata.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "gemma2",
    "gemma3_text",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)
MLP_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
    # A mixture of experts (Mixtral, Qwen3-MoE) in the layers `moe_layers`: a softmax router
    # picks `num_experts_per_tok` of `num_experts` SwiGLU experts (`moe_intermediate_size`
    # each) per token, their weights renormalized to sum to 1 when `norm_topk_prob`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Gemma 2/3: (1 + w) RMSNorms, norms on the attention's and the MLP's outputs too, the
    # embeddings times sqrt(hidden), GeGLU (tanh GELU), attention scaled by
    # query_pre_attn_scalar^-0.5, tanh soft-capping of the attention scores and final logits
    norm_offset: bool = False
    sandwich_norms: bool = False
    embedding_multiplier: float | None = None
    mlp_activation: str = "silu"  # or "gelu_tanh"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Each layer's attention window where layers differ (Gemma's local and global layers,
    # Qwen's `max_window_layers`; None: full attention); empty: `sliding_window` everywhere
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3's windowed layers' RoPE base (unscaled)
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
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {ROPE_TYPES}")
        if rope_type == "longrope" and self.architecture != "phi3":
            raise ValueError("rope scaling 'longrope' is supported for phi3 only")

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def with_context(self, max_model_len: int) -> ModelConfig:
        """This config for an engine serving up to `max_model_len` tokens: LongRoPE takes its
        long factors when that passes the original context, its short ones otherwise (fixed for
        the engine's life, so every cached key is rotated alike; transformers switches per
        forward on the longest position)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.get("rope_type") != "longrope":
            return self
        long = max_model_len > int(scaling["original_max_position_embeddings"])
        return dataclasses.replace(self, rope_scaling={**scaling, "long": long})

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
        if rope_scaling is not None and model_type == "phi3":
            rope_scaling = _phi3_longrope(config, rope_scaling)
        if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(
                f"partial_rotary_factor {config['partial_rotary_factor']} (RoPE over part of each "
                "head) is not supported yet: kvfleet rotates whole heads"
            )
        gemma = _hf_gemma(config, model_type)
        if gemma.pop("local_rope", None) is not None:  # Gemma 3's per-kind RoPE parameters
            rope_theta, rope_scaling = _hf_rope(gemma["rope_full"])
        gemma.pop("rope_full", None)
        is_qwen2 = model_type == "qwen2"
        sliding_window, layer_windows = _windows(config, model_type)
        moe = _hf_moe(config, model_type)
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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            **moe,
            **gemma,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=int_tuple(eos),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            quantization_config=config.get("quantization_config"),
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


def _phi3_longrope(config: Mapping[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's rope_scaling as transformers reads it: types "su" and "yarn" are LongRoPE; the
    original context from the config's top level (4096 by default); the factor from the ratio
    of the two contexts. Which factors apply is fixed per engine (`with_context`)."""
    if scaling["rope_type"] in ("su", "yarn"):
        scaling = {**scaling, "rope_type": "longrope"}
    original = scaling.get("original_max_position_embeddings")
    original = int(original or config.get("original_max_position_embeddings") or 4096)
    factor = scaling.get("factor") or int(config["max_position_embeddings"]) / original
    return {**scaling, "original_max_position_embeddings": original, "factor": factor}


def _windows(
    config: Mapping[str, Any], model_type: str
) -> tuple[int | None, tuple[int | None, ...]]:
    """(the sliding window every layer uses, or None; each layer's where they differ) from
    transformers' `layer_types`, or as it derives them: Qwen2/Qwen3 window the layers from
    `max_window_layers` on, only with `use_sliding_window`; Gemma 2 every other layer (the
    first windowed), Gemma 3 five of every `sliding_window_pattern` (6)."""
    window = config.get("sliding_window")
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None and model_type in ("qwen2", "qwen3", "qwen3_moe"):
        windowed = bool(config.get("use_sliding_window", False) and window)
        first = int(config.get("max_window_layers", layers)) if windowed else layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None and model_type in ("gemma2", "gemma3_text"):
        pattern = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern") or 6)
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if types is None:
        return (int(window) if window else None), ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != layers or ("sliding_attention" in types and not window):
        raise ValueError(
            f"layer_types {sorted(set(types))} for {layers} layers (with sliding_window "
            f"{window}) are not supported; kvfleet runs sliding_attention and full_attention"
        )
    size = int(window or 0)
    windows = tuple(size if kind == "sliding_attention" else None for kind in types)
    if len(set(windows)) == 1:
        return windows[0], ()
    return None, windows


def _hf_gemma(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 2/3's fields (none for other families); `local_rope` and `rope_full` carry Gemma
    3's RoPE parameters per layer kind for the caller. Bidirectional attention is refused."""
    default = "gelu_pytorch_tanh" if model_type.startswith("gemma") else "silu"
    activation = config.get("hidden_activation") or config.get("hidden_act") or default
    if activation not in MLP_ACTIVATIONS or (
        MLP_ACTIVATIONS[activation] != "silu" and not model_type.startswith("gemma")
    ):
        raise ValueError(
            f"hidden_act {activation!r} is not supported for {model_type!r}; kvfleet runs "
            "SiLU-gated MLPs (GELU-gated for Gemma)"
        )
    if not model_type.startswith("gemma"):
        return {}
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a decoder only)")
    fields: dict[str, Any] = {
        "norm_offset": True,
        "sandwich_norms": True,
        "embedding_multiplier": float(config["hidden_size"]) ** 0.5,
        "mlp_activation": MLP_ACTIVATIONS[activation],
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar") or 256),
        "attn_logit_softcap": _positive(config.get("attn_logit_softcapping")),
        "final_logit_softcap": _positive(config.get("final_logit_softcapping")),
    }
    if model_type == "gemma3_text":
        params = dict(config.get("rope_parameters") or {})
        if "full_attention" in params:  # (transformers 5: one set per layer kind)
            full, local = dict(params["full_attention"]), dict(params["sliding_attention"])
        else:
            full = {
                "rope_theta": config.get("rope_theta", 1_000_000.0),
                "rope_scaling": config.get("rope_scaling"),
            }
            local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError("RoPE scaling of Gemma 3's sliding-window layers is not supported")
        fields["local_rope_theta"] = float(local["rope_theta"])
        fields["local_rope"] = local
        fields["rope_full"] = {"rope_parameters": full} if "rope_type" in full else full
    return fields


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _hf_moe(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json (none for a dense
    model). Qwen3-MoE runs a dense MLP in `mlp_only_layers` and wherever (layer + 1) is no
    multiple of `decoder_sparse_step`; Mixtral's router always renormalizes its top k."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    layers = range(int(config["num_hidden_layers"]))
    if model_type == "mixtral":
        moe_layers = tuple(layers) if experts else ()
        inner, renormalize = int(config["intermediate_size"]), True
    else:
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in layers if experts and i not in dense and (i + 1) % step == 0)
        inner = int(config.get("moe_intermediate_size") or 0)
        renormalize = bool(config.get("norm_topk_prob", False))
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(config.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": inner,
        "norm_topk_prob": renormalize,
        "moe_layers": moe_layers,
    }


def int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
