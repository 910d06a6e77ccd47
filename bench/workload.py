"""Workloads and their floors, shared by the benchmarks and the peer script.

A workload is a list of prompts (random token ids, seeded, so the peer gets the very same
requests) and output lengths. Its cost is counted from the model config alone:

- FLOPs: 2 x matmul parameters of the layers per computed token, 2 x hidden x vocab per sampled
  token (the LM head), and attention (4 x heads x head_dim per query-key pair per layer: Q·K and
  P·V; causal prefill counts the pairs it needs, n(n+1)/2).
- Bytes: the weights read once per step, times the fewest steps the workload can take (a request
  emits one token per step, and a step holds at most max_num_seqs requests), plus the KV cache:
  every token's K/V written once, the prompt's read once by its prefill, and the whole context
  read again by every decode step.

The floor is the larger of bytes over the measured copy bandwidth and FLOPs over the measured
matmul rate (`ceilings.py`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvfleet.engine.config import ModelConfig


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float


def parse_range(text: str) -> tuple[int, int]:
    """'256' -> (256, 256); '128:1024' -> (128, 1024), both ends included."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"a length must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """Uniform lengths in each range; token ids clear of the first and last 100 (specials)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(n)])
        outputs.append(rng.randint(*output_len))
    return Workload(prompts, outputs)


def layer_matmul_params(config: ModelConfig, active: bool = False) -> int:
    """Matmul weights of the decoder layers (norms and embeddings excluded); `active`: only
    those one token multiplies (of a mixture of experts: the router and its top k experts)."""
    hidden = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    dense = 3 * hidden * config.intermediate_size
    experts = config.num_experts_per_tok if active else config.num_experts
    moe = hidden * config.num_experts + experts * 3 * hidden * config.moe_intermediate_size
    num_moe = len(config.moe_layers)
    return (
        config.num_hidden_layers * attention
        + (config.num_hidden_layers - num_moe) * dense
        + (num_moe * moe)
    )


def experts_read(config: ModelConfig, batch_size: float) -> float:
    """How many of a layer's experts a step of `batch_size` tokens reads, expected under
    uniform routing (each token picks top k distinct experts): E (1 - (1 - k / E)^batch)."""
    experts, top_k = config.num_experts, config.num_experts_per_tok
    if not config.moe_layers:
        return 0.0
    return float(experts * (1 - (1 - top_k / experts) ** batch_size))


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return 2 * config.num_key_value_heads * config.head_dim * dtype_bytes * config.num_hidden_layers


def weight_bytes_per_step(
    config: ModelConfig, dtype_bytes: int, batch_size: float | None = None
) -> float:
    """What one step must read: the layers' weights (of a mixture of experts, the experts a
    step of `batch_size` tokens reads, all of them when None), the norms and the LM head."""
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    lm_head = config.vocab_size * config.hidden_size
    params = float(layer_matmul_params(config))
    if config.moe_layers and batch_size is not None:
        unread = config.num_experts - experts_read(config, batch_size)
        params -= (
            len(config.moe_layers)
            * unread
            * 3
            * config.hidden_size
            * (config.moe_intermediate_size)
        )
    return (params + norms + lm_head) * dtype_bytes


def workload_cost(
    config: ModelConfig,
    dtype_bytes: int,
    workload: Workload,
    max_num_seqs: int,
    weight_bytes: float | None = None,
    linear_flops_factor: float = 1.0,
    kv_dtype_bytes: int | None = None,
) -> Cost:
    """Bytes and FLOPs of the workload at the model dtype's matmul rate. Quantized weights:
    `weight_bytes` read per step (default: every weight in the dtype), and the layers' matmul
    FLOPs weighed by `linear_flops_factor` (the dtype's matmul rate over the quantized one).
    An FP8 KV cache: `kv_dtype_bytes` 1."""
    layers = config.num_hidden_layers
    attn_per_pair = 4 * config.num_attention_heads * config.head_dim * layers
    computed = workload.num_input_tokens + workload.num_output_tokens
    flops = 2.0 * layer_matmul_params(config, active=True) * computed * linear_flops_factor
    flops += 2.0 * config.hidden_size * config.vocab_size * workload.num_output_tokens
    kv_token = kv_bytes_per_token(config, kv_dtype_bytes or dtype_bytes)
    kv_bytes = 0.0
    for prompt, out in zip(workload.prompts, workload.output_lens, strict=True):
        n = len(prompt)
        # Decode token j (0-based) of this request attends to n + j + 1 positions.
        decode_pairs = out * n + out * (out + 1) / 2
        flops += attn_per_pair * (n * (n + 1) / 2 + decode_pairs)
        kv_bytes += kv_token * ((n + out) + n + decode_pairs)  # written, prompt read, decode read
    steps = max(
        max(workload.output_lens, default=0),
        math.ceil(workload.num_output_tokens / max_num_seqs),
    )
    batch = min(max_num_seqs, len(workload.prompts))
    per_step = (
        weight_bytes_per_step(config, dtype_bytes, batch) if weight_bytes is None else weight_bytes
    )
    return Cost(bytes=steps * per_step + kv_bytes, flops=flops)
