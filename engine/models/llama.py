"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a flattened
varlen batch.

One module serves them all: they differ in config only (QKV bias, tied embeddings, rope scaling,
sliding window, Qwen3's RMSNorm over each head of q and k). Q/K/V and gate/up are fused into
one matmul each; `load_weights` takes Hugging Face tensor names and fills the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.engine.attention.metadata import AttentionLayer, AttentionMetadata
from kvfleet.engine.config import ModelConfig
from kvfleet.engine.layers.quantization.linear import (
    LinearFactory,
    QuantizedLinear,
    expect_shape,
    layer_bias,
    linear_without_bias,
    make_linear_factory,
)
from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding, silu_and_mul

if TYPE_CHECKING:
    from kvfleet.engine.parallel.group import TPGroup

AttentionFactory = Callable[[ModelConfig], AttentionLayer]
# A calibrated FP8 KV scale maps the first prompt's largest K or V to this (e4m3 reaches 448:
# 2x headroom for what later prompts hold, and for RoPE's rotation of K)
KV_CALIBRATION_RANGE = 224.0


def row_parallel(linear: nn.Module, x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A linear layer whose input features are split over the ranks: this rank's partial sum
    (the bias, replicated, added on rank 0 only). `reduce_and_norm` sums the ranks' parts."""
    if tp is None:
        out: torch.Tensor = linear(x)
        return out
    out = linear_without_bias(linear, x)
    bias = layer_bias(linear)
    return out + bias if bias is not None and tp.rank == 0 else out


def reduce_and_norm(
    norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None, tp: TPGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm(hidden, residual)`, where with tensor parallelism `hidden` is each rank's partial
    sum (a row-parallel layer's output): summed over the ranks first, in the norm's kernel when
    peer memory allows."""
    if tp is None:
        normed: tuple[torch.Tensor, torch.Tensor] = norm(hidden, residual)
        return normed
    return tp.all_reduce_add_rms_norm(hidden, residual, norm)


class LlamaAttention(nn.Module):
    kv_scales: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionLayer,
        linear: LinearFactory,
        prefix: str,
        tp: TPGroup | None = None,
    ):
        """`config` has this rank's heads (all of them without tensor parallelism); `prefix`
        names the layer's attention in the checkpoint."""
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(
            tuple(f"{prefix}.{part}_proj" for part in "qkv"),
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.qkv_bias,
        )
        self.o_proj = linear((f"{prefix}.o_proj",), self.q_size, config.hidden_size, config.o_bias)
        # (torch ops on every device: a few small kernels per layer, fusion left for later)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        # An FP8 KV cache's K and V scales: the checkpoint's (k_scale, v_scale), else 1.0, or
        # measured on the first prompt when `calibrate_kv` is set (`calibrate_kv_scales`)
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)
        self.calibrate_kv = False
        self.kv_scales_given = False

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        if self.calibrate_kv and num_tokens > 1:  # (a prompt; K's amax before RoPE: headroom)
            amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
            self.kv_scales.copy_(amax.clamp_min(KV_CALIBRATION_RANGE * 1e-6) / KV_CALIBRATION_RANGE)
            self.calibrate_kv = False
        out = self.backend.forward_rotary(
            self.rotary, positions, q, k, v, kv_cache, metadata, self.kv_scales
        )
        return row_parallel(self.o_proj, out.view(num_tokens, self.q_size), self.tp)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        linear: LinearFactory,
        prefix: str,
        fused: bool = False,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.fused = fused
        self.tp = tp
        size, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = linear(
            (f"{prefix}.gate_proj", f"{prefix}.up_proj"), size, 2 * inner, bias
        )
        self.down_proj = linear((f"{prefix}.down_proj",), inner, size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.down_proj, silu_and_mul(self.gate_up_proj(x), self.fused), self.tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionLayer,
        fused: bool,
        linear: LinearFactory,
        prefix: str,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.self_attn = LlamaAttention(config, rotary, backend, linear, f"{prefix}.self_attn", tp)
        self.mlp = LlamaMLP(config, linear, f"{prefix}.mlp", fused, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the last layer's output (the embeddings for the first), with tensor
        parallelism each rank's partial sum; so is the output."""
        hidden, residual = reduce_and_norm(self.input_layernorm, hidden, residual, self.tp)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = reduce_and_norm(self.post_attention_layernorm, hidden, residual, self.tp)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionFactory,
        fused: bool = False,
        tp: TPGroup | None = None,
        linear: LinearFactory | None = None,
    ):
        """`fused`: Triton kernels for norms and RoPE on CUDA (the fast path); the torch
        layers otherwise (the reference). `tp`: this rank's part of a tensor-parallel model
        (`self.config` then has this rank's head and MLP sizes; the vocabulary stays whole).
        `linear` builds the projections (quantized ones; plain `nn.Linear` by default)."""
        super().__init__()
        self.tp = tp
        self.full_config = config
        config = tp.plan.local_config(config) if tp is not None else config
        self.config = config
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            fused,
        )
        vocab_rows = tp.plan.vocab_per_rank if tp is not None else config.vocab_size
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        linear = linear or make_linear_factory(None, torch.get_default_dtype())
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, rotary, attention(config), fused, linear, f"model.layers.{i}", tp
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, vocab_rows, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden: torch.Tensor = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = reduce_and_norm(self.norm, hidden, residual, self.tp)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]; with tensor parallelism each rank looks up the
        ids in its vocabulary shard (zero rows for the others'), a partial sum like a
        row-parallel layer's, which the first norm sums over the ranks."""
        if self.tp is None:
            found: torch.Tensor = self.embed_tokens(input_ids)
            return found
        vocab = self.tp.plan.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= vocab.size)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        partial: torch.Tensor = hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return partial

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] float32 logits; with tensor parallelism
        and not `gather`, this rank's (padded) vocabulary shard of them."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if hidden.is_cuda and hidden.dtype != torch.float32:
            # NOTE: float32 out of the matmul itself: bf16 logits near 20 are 0.125 apart, so
            # greedy near-ties would be decided by rounding noise rather than by the model.
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:
            logits = (hidden @ weight.t()).float()
        if self.tp is None or not gather:
            return logits
        return self.tp.gather_vocab(logits)[:, : self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters, quantized layers
        filling themselves; every one must be set."""
        params = dict(self.named_parameters())
        for module in self.modules():  # (buffers come uninitialized from the meta device)
            if isinstance(module, LlamaAttention):
                module.kv_scales.fill_(1.0)
        quantized = {
            name: module
            for name, module in self.named_modules()
            if isinstance(module, QuantizedLinear)
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _map_hf_name(hf_name, self.config)
            if target is None:
                continue
            name, shard = target
            owner, _, kind = name.rpartition(".")
            if kind in ("k_scale", "v_scale"):  # (an FP8 KV cache's, per layer)
                self._load_kv_scale(owner, kind, tensor, hf_name)
                continue
            if owner in quantized:
                quantized[owner].load_part(kind, tensor, shard, hf_name)
                loaded.add(f"{name}:{shard}")
                continue
            param = _plain_target(params, name, tensor, hf_name)
            dest = param.data if shard is None else param.data.narrow(0, *shard)
            if self.tp is not None and name in ("embed_tokens.weight", "lm_head.weight"):
                dest[tensor.shape[0] :].zero_()  # the padding rows of the last vocabulary shard
                dest = dest[: tensor.shape[0]]
            expect_shape(hf_name, tensor, tuple(dest.shape))
            dest.copy_(tensor)
            loaded.add(f"{name}:{shard}")
        missing = sorted(
            name
            for name, part in _expected_parts(self, params, quantized)
            if f"{name}:{part}" not in loaded
        )
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for layer in quantized.values():
            layer.finish_loading()

    def calibrate_kv_scales(self) -> None:
        """Layers whose K and V scales the checkpoint did not give measure them on the next
        prompt."""
        for module in self.modules():
            if isinstance(module, LlamaAttention) and not module.kv_scales_given:
                module.calibrate_kv = True

    def _load_kv_scale(self, owner: str, kind: str, tensor: torch.Tensor, hf_name: str) -> None:
        value = float(tensor.reshape(())) if tensor.numel() == 1 else float("nan")
        if not 0.0 < value < float("inf"):
            raise ValueError(f"checkpoint tensor {hf_name!r} is no positive scale")
        try:
            attention = self.get_submodule(owner)
        except AttributeError:
            attention = None
        if not isinstance(attention, LlamaAttention):
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
        attention.kv_scales[int(kind == "v_scale")] = value
        attention.kv_scales_given = True


def _plain_target(
    params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, hf_name: str
) -> nn.Parameter:
    """The parameter of a layer kept in the model dtype that `hf_name` fills."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
    if tensor.dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is quantized ({tensor.dtype}); kvfleet reads "
            "quantized weights for the attention and MLP projections only (the embeddings, "
            "norms and LM head stay in the model dtype)"
        )
    return params[name]


_SHARDED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _map_hf_name(hf_name: str, config: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """A Hugging Face tensor name -> (our parameter, (row offset, rows) or None); None to skip."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    name = hf_name.removeprefix("model.")
    for hf_part, (ours, index) in _SHARDED.items():
        marker = f".{hf_part}."
        if marker in name:
            return name.replace(marker, f".{ours}."), _shard_rows(ours, index, config)
    return name, None


def _shard_rows(fused: str, index: int, config: ModelConfig) -> tuple[int, int]:
    if fused == "gate_up_proj":
        return index * config.intermediate_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    offsets = (0, q_size, q_size + kv_size)
    return offsets[index], (q_size, kv_size, kv_size)[index]


def _expected_parts(
    model: LlamaForCausalLM,
    params: dict[str, nn.Parameter],
    quantized: dict[str, QuantizedLinear],
) -> Iterable[tuple[str, tuple[int, int] | None]]:
    names = [name for name in params if name.rpartition(".")[0] not in quantized]
    names += [f"{owner}.{kind}" for owner, q in quantized.items() for kind in q.checkpoint_parts()]
    for name in names:
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            yield name, None
        else:
            for index in range(3 if fused == "qkv_proj" else 2):
                yield name, _shard_rows(fused, index, model.config)
