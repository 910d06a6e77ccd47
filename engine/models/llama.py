"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a flattened
varlen batch.

One module serves them all: they differ in config only (QKV bias, tied embeddings, rope scaling,
sliding windows per layer, Qwen3's RMSNorm over each head of q and k, a mixture of experts in
place of the MLP for Mixtral and Qwen3-MoE, Gemma's norms, GeGLU and soft-capping). Q/K/V and
gate/up are fused into one matmul each; `load_weights` (weights.py) takes Hugging Face tensor
names and fills the fused parameters and the stacked experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.engine.attention.metadata import AttentionLayer, AttentionMetadata
from kvfleet.engine.config import ModelConfig
from kvfleet.engine.layers.linear import SplitRows, UnnormalizedRow, float32_logits
from kvfleet.engine.layers.moe import SparseMoeBlock
from kvfleet.engine.layers.quantization.fp8 import QuantizedRows, takes_quantized_rows
from kvfleet.engine.layers.quantization.linear import LinearFactory, make_linear_factory
from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding, act_and_mul
from kvfleet.engine.models.parallel_rows import norm_for, reduce_and_norm, row_parallel, whole

if TYPE_CHECKING:
    from kvfleet.engine.parallel.group import TPGroup

AttentionFactory = Callable[[ModelConfig], AttentionLayer]
# A calibrated FP8 KV scale maps the first prompt's largest K or V to this (e4m3 reaches 448:
# 2x headroom for what later prompts hold, and for RoPE's rotation of K)
KV_CALIBRATION_RANGE = 224.0


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
        fused: bool = False,
    ):
        """`config` has this rank's heads (all of them without tensor parallelism); `prefix`
        names the layer's attention in the checkpoint; `fused`: Triton q/k norms on CUDA."""
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
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.q_norm = RMSNorm(self.head_dim, eps, fused, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, fused, offset) if config.qk_norm else None
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
        hidden: torch.Tensor | QuantizedRows | UnnormalizedRow,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm, self.k_norm)  # (the backend may fuse them into RoPE)
        args = (self.qkv_proj, hidden, self.rotary, positions, kv_cache, metadata, self.kv_scales)
        out = self.backend.attend_projected(*args, norms, self.o_proj if self.tp is None else None)
        if isinstance(out, SplitRows):  # (its splits merged by o's GEMV)
            merged: torch.Tensor = self.o_proj(out)
            return merged
        if out is not None:  # (one token: its norms, RoPE and cache write made by the GEMV)
            return row_parallel(self.o_proj, out.view(num_tokens, self.q_size), self.tp)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.calibrate_kv and num_tokens > 1:  # (a prompt; K's amax before RoPE: headroom)
            if norms is not None:
                q, _ = norms[0](q)
                k, _ = norms[1](k)
                norms = None
            amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
            self.kv_scales.copy_(amax.clamp_min(KV_CALIBRATION_RANGE * 1e-6) / KV_CALIBRATION_RANGE)
            self.calibrate_kv = False
        out = self.backend.forward_rotary(
            self.rotary, positions, q, k, v, kv_cache, metadata, self.kv_scales, norms
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
        self.activation = config.mlp_activation

    def forward(self, x: torch.Tensor | QuantizedRows | UnnormalizedRow) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        inner: torch.Tensor | QuantizedRows
        if self.fused and self.tp is None and takes_quantized_rows(self.down_proj, gate_up):
            from kvfleet.engine.layers import triton_layers

            inner = triton_layers.act_and_mul_fp8(gate_up, self.activation)
        else:
            inner = act_and_mul(gate_up, self.fused, self.activation)
        return row_parallel(self.down_proj, inner, self.tp)


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
        moe: bool = False,
    ):
        """`moe`: a mixture of experts in place of the MLP."""
        super().__init__()
        self.tp = tp
        self.self_attn = LlamaAttention(
            config, rotary, backend, linear, f"{prefix}.self_attn", tp, fused
        )
        self.mlp: nn.Module = (
            SparseMoeBlock(
                config.num_experts,
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                fused,
            )
            if moe
            else LlamaMLP(config, linear, f"{prefix}.mlp", fused, tp)
        )

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, fused, config.norm_offset)

        self.input_layernorm = norm()
        # Llama: the norm before the MLP (adding the attention's output to the residual first);
        # Gemma ("sandwich"): the attention output's own norm, then pre_feedforward_layernorm
        # before the MLP and post_feedforward_layernorm on its output
        self.post_attention_layernorm = norm()
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the last layer's output (the embeddings for the first), with tensor
        parallelism each rank's partial sum; so is the output. (Sandwich norms: whole sums in
        and out, the attention's and the MLP's outputs summed over the ranks for their norms.)"""
        # (an FP8 layer's rows quantized by the norm's kernel: `norm_for`; the modules looked up
        # now, after any LoRA wrapping; the MLP's gate_up or the experts' block takes the row)
        qkv = self.self_attn.qkv_proj
        after = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else self.mlp
        if not self.sandwich:
            normed, residual = norm_for(self.input_layernorm, qkv, hidden, residual, self.tp)
            hidden = self.self_attn(positions, normed, kv_cache, metadata)
            normed, residual = norm_for(
                self.post_attention_layernorm, after, hidden, residual, self.tp
            )
            return self.mlp(normed), residual
        # (their input and pre-feed-forward norms made by the qkv and gate_up GEMVs lost:
        # Gemma-3-12B batch 1 6.946 -> 6.961 ms, bench/RESULTS.md session 47)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, _ = self.post_attention_layernorm(whole(hidden, self.tp))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(whole(self.mlp(hidden), self.tp))
        return hidden, residual


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
        # (Gemma 3's windowed layers turn at their own base, unscaled)
        local_rotary = rotary
        if config.local_rope_theta is not None:
            local_rotary = RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                config.local_rope_theta,
                None,
                fused,
            )
        vocab_rows = tp.plan.vocab_per_rank if tp is not None else config.vocab_size
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        linear = linear or make_linear_factory(None, torch.get_default_dtype())
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                rotary if config.window_of(i) is None else local_rotary,
                attention(layer_config(config, i)),
                fused,
                linear,
                f"model.layers.{i}",
                tp,
                moe=i in config.moe_layers,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, config.norm_offset)
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
        tp = self.tp
        if self.config.sandwich_norms:  # (its layers take and give whole sums)
            hidden, tp = whole(hidden, tp), None
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = reduce_and_norm(self.norm, hidden, residual, tp)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]; with tensor parallelism each rank looks up the
        ids in its vocabulary shard (zero rows for the others'), a partial sum like a
        row-parallel layer's, which the first norm sums over the ranks."""
        if self.tp is None:
            found: torch.Tensor = self.embed_tokens(input_ids)
            return self._scaled(found)
        vocab = self.tp.plan.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= vocab.size)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        partial: torch.Tensor = hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self._scaled(partial)

    def _scaled(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Gemma's embeddings times sqrt(hidden), the factor rounded to the model dtype first
        as transformers does."""
        multiplier = self.config.embedding_multiplier
        if multiplier is None:
            return embeddings
        return embeddings * torch.tensor(multiplier, dtype=embeddings.dtype)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] float32 logits; with tensor parallelism
        and not `gather`, this rank's (padded) vocabulary shard of them."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = float32_logits(hidden, weight)
        cap = self.config.final_logit_softcap
        if cap is not None:  # (Gemma 2: cap * tanh(logits / cap))
            logits = torch.tanh(logits / cap) * cap
        if self.tp is None or not gather:
            return logits
        return self.tp.gather_vocab(logits)[:, : self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters, quantized layers
        filling themselves; every one must be set (`weights.load_hf_weights`)."""
        from kvfleet.engine.models.weights import load_hf_weights

        load_hf_weights(self, weights)

    def calibrate_kv_scales(self) -> None:
        """Layers whose K and V scales the checkpoint did not give measure them on the next
        prompt."""
        for module in self.modules():
            if isinstance(module, LlamaAttention) and not module.kv_scales_given:
                module.calibrate_kv = True


def layer_config(config: ModelConfig, layer: int) -> ModelConfig:
    """The config one layer's attention is built from: its own sliding window."""
    if not config.layer_windows:
        return config
    return dataclasses.replace(config, sliding_window=config.window_of(layer), layer_windows=())
