"""What every engine process sets up from the EngineConfig: the device, dtype and model source,
its place in a tensor-parallel group, its model shard, the draft model, and the KV cache size.

Rank 0 (`LLMEngine`) and the tensor-parallel workers (`build_rank`) build themselves through
these functions in the same order, so their collectives match.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from dataclasses import dataclass

import torch

from kvfleet.engine.attention.metadata import AttentionLayer
from kvfleet.engine.attention.torch_backend import TorchAttention
from kvfleet.engine.config import EngineConfig, ModelConfig
from kvfleet.engine.layers.quantization.scheme import (
    PackedScheme,
    QuantScheme,
    resolve_quantization,
)
from kvfleet.engine.loader.model_loader import load_model
from kvfleet.engine.loader.source import ModelSource, resolve_model_source
from kvfleet.engine.models.llama import AttentionFactory, LlamaForCausalLM
from kvfleet.engine.parallel.group import TPGroup
from kvfleet.engine.parallel.partition import TPPlan
from kvfleet.engine.spec_decode.speculator import Speculator
from kvfleet.engine.worker.draft_model import DraftModelProposer
from kvfleet.engine.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from kvfleet.engine.worker.prefill_graphs import prefill_graph_bytes
from kvfleet.engine.worker.step_tail_warm_up import warm_up_step_tail

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# CUDA graphs' memory pool and allocator fragmentation, beside the profiled step.
_GRAPHS_RESERVE = _GIB // 2
_PEER_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class RankSetup:
    """What every tensor-parallel rank derives alike from the EngineConfig."""

    source: ModelSource
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    attention_backend: str
    quantization: QuantScheme | None = None
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype

    def describe(self, num_blocks: int, block_size: int) -> str:
        quantized = f", weights {self.quantization.describe()}" if self.quantization else ""
        kv = " fp8 e4m3" if self.kv_cache_dtype == torch.float8_e4m3fn else ""
        return (
            f"{self.source.name} ({self.source.format}) on {self.device} in {self.dtype}"
            f"{quantized}, {self.attention_backend} attention; {num_blocks}{kv} KV blocks of "
            f"{block_size} tokens; max_model_len {self.max_model_len}"
        )


def resolve_setup(config: EngineConfig, rank: int = 0) -> RankSetup:
    device = _pick_device(config.device)
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        device = torch.device("cuda", rank)  # one GPU per rank
    source = resolve_model_source(config.model, config.load_format)
    model_config = source.read_config()
    max_model_len = _max_model_len(config, model_config)
    model_config = model_config.with_context(max_model_len)
    return RankSetup(
        source=source,
        model_config=model_config,
        dtype=_pick_dtype(config.dtype, model_config, device),
        device=device,
        max_model_len=max_model_len,
        attention_backend=_pick_attention_backend(config.attention_backend, device),
        quantization=pick_quantization(
            config.quantization, source, model_config, device, config.tensor_parallel_size
        ),
        kv_cache_dtype=torch.float8_e4m3fn if config.cache.kv_cache_dtype != "auto" else None,
    )


def pick_quantization(
    method: str | None,
    source: ModelSource,
    model_config: ModelConfig,
    device: torch.device,
    tensor_parallel_size: int = 1,
) -> QuantScheme | None:
    """The scheme for the `quantization` setting and the checkpoint; ValueError before any
    weight loads when they disagree or the device cannot run it. Random (dummy) weights take a
    quantized checkpoint's scheme quantized at load (benchmarks at its shapes; AWQ and GPTQ as
    INT4 rounded to nearest, the layout both load into)."""
    checkpoint = model_config.quantization_config
    if source.format == "dummy" and checkpoint is None and method in ("awq", "gptq"):
        method = "rtn"
    if method == "gguf" and source.format == "gguf":
        # NOTE: asked for, not the default for GGUF files: the INT4 kernels are faster than
        # bf16 for one sequence but slower for batches (bench/RESULTS.md, session 14)
        from kvfleet.engine.loader.gguf import gguf_packed_scheme

        gguf = gguf_packed_scheme(source.path)
        if gguf is None:
            raise ValueError(
                f"quantization='gguf': {source.path.name} has no Q4_0 / Q4_1 / Q4_K / Q8_0 "
                "projection layers to keep packed (other GGUF types are dequantized at load)"
            )
        return gguf
    scheme = resolve_quantization(method, checkpoint)
    if scheme is None:
        return None
    if isinstance(scheme, PackedScheme):
        if source.format == "dummy" and scheme.from_checkpoint:
            scheme = PackedScheme(source="online", group_size=scheme.group_size)
        if tensor_parallel_size > 1 and scheme.act_order:
            raise ValueError(
                f"{scheme.describe()}: act-order GPTQ checkpoints are not supported with tensor "
                "parallelism (a rank's share of the inputs would mix every group); serve it "
                "with tensor_parallel_size 1"
            )
        return scheme
    if source.format == "dummy" and scheme.from_checkpoint:
        scheme = dataclasses.replace(
            scheme, source="online", activations="group" if scheme.block else "token"
        )
    from kvfleet.engine.layers.quantization.fp8 import fp8_supported

    reason = fp8_supported(device)
    if reason is not None:
        raise ValueError(f"{scheme.describe()} cannot run here: {reason}")
    return scheme


def join_group(setup: RankSetup, rank: int, world_size: int, port: int) -> TPGroup | None:
    """This rank's place in the tensor-parallel group (None without tensor parallelism)."""
    if world_size == 1:
        return None
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    else:  # ranks share the cores instead of each taking all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    plan = TPPlan.build(setup.model_config, rank, world_size)
    return TPGroup.initialize(plan, setup.device, port)


def load_rank_model(config: EngineConfig, setup: RankSetup, tp: TPGroup | None) -> LlamaForCausalLM:
    torch.manual_seed(config.seed)
    return load_model(
        setup.source,
        setup.model_config,
        setup.dtype,
        setup.device,
        _attention_factory(setup.attention_backend),
        config.seed,
        fused=setup.attention_backend == "triton",
        tp=tp,
        quantization=setup.quantization,
    )


def build_rank(
    config: EngineConfig, rank: int, world_size: int, port: int
) -> tuple[ModelRunner, TPGroup]:
    """A tensor-parallel worker's runner: its model shard and KV cache, built in the same order
    (and so with the same collectives) as rank 0's engine builds its own."""
    setup = resolve_setup(config, rank)
    tp = join_group(setup, rank, world_size, port)
    assert tp is not None
    model = load_rank_model(config, setup, tp)
    enable_peer_all_reduce(config, setup, tp)
    runner = ModelRunner(
        model, config.cache.block_size, setup.dtype, setup.device, None, setup.kv_cache_dtype
    )
    runner.allocate_kv_cache(tp.min_int(num_kv_blocks(config, runner, setup)))
    if uses_graphs(config, setup):
        runner.enable_decode_graphs(
            config.scheduler.max_num_seqs, setup.max_model_len, graph_query_len(config)
        )
    warm_up_step_tail(runner)  # (its own shard's race: a compile would hold the others too)
    if config.cache.calculate_kv_scales:
        model.calibrate_kv_scales()
    return runner, tp


def graph_query_len(config: EngineConfig) -> int:
    """Tokens per sequence the target's graphs take: a token and its drafts."""
    return 1 + config.speculative.num_speculative_tokens if config.speculative else 1


def freeze_startup_heap() -> None:
    """Put everything built so far (an engine's KV-cache blocks, modules, graphs: ~400,000
    objects at TP=2 on Llama-3-8B) out of the garbage collector's reach. Otherwise each full
    collection walks them all: 6 of ~90 ms each in one 256-request run on 2 x H200, stalling
    the step loop while the GPUs wait. For processes that serve one engine for their life (the
    server, tensor-parallel workers, benchmarks): a frozen engine's reference cycles (the free
    block queue's links) are never collected."""
    gc.collect()
    gc.freeze()


def enable_peer_all_reduce(config: EngineConfig, setup: RankSetup, tp: TPGroup) -> None:
    """All-reduces through peer memory where the GPUs have it, each fused with the RMSNorm
    after it: one-shot for decode batches (up to max_num_seqs x hidden, at most 4 MiB), two-shot
    for larger steps (up to max_num_batched_tokens rows; 8,192 x 4,096 on 2 x H200: 238 us
    against 321 for NCCL then the norm). Plain all-reduces above 4 MiB stay with NCCL, whose
    ring beats the one-shot there (64 MiB: 266 us against 549). Before the KV cache is sized,
    which counts the buffer (4 halves of the largest step's rows for the two-shot)."""
    element = torch.empty((), dtype=setup.dtype).element_size()
    sched = config.scheduler
    hidden = setup.model_config.hidden_size
    numel = min(sched.max_num_seqs * hidden, _PEER_MAX_BYTES // element)
    rows = sched.max_num_batched_tokens
    on = tp.enable_peer_all_reduce(numel, setup.dtype, hidden, rows)
    if tp.rank == 0:
        logger.info(
            "all-reduces: %s", "peer memory (fused with the norms)" if on else "NCCL / gloo"
        )


def uses_graphs(config: EngineConfig, setup: RankSetup) -> bool:
    return setup.attention_backend == "triton" and not config.enforce_eager


def prefill_graph_tokens(config: EngineConfig, setup: RankSetup) -> int:
    """Steps holding prompt tokens, up to this many, replay graphs in pieces (0: none): where
    graphs are used at all, on one GPU (the pieces hold no tensor-parallel collectives yet),
    and no more than a step may hold."""
    if not uses_graphs(config, setup) or config.tensor_parallel_size > 1:
        return 0
    return min(config.prefill_graph_tokens, config.scheduler.max_num_batched_tokens)


def load_draft(config: EngineConfig, setup: RankSetup) -> ModelRunner | None:
    """The draft model's runner (its KV cache not allocated yet) for the `draft` speculative
    method, else None. Dummy weights for a dummy target (random drafts, for benchmarks)."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    source = resolve_model_source(spec.model, "dummy" if setup.source.format == "dummy" else "auto")
    draft_config = source.read_config().with_context(setup.max_model_len)
    if draft_config.vocab_size != setup.model_config.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {draft_config.vocab_size} "
            f"tokens, the target {setup.model_config.vocab_size}: a draft model must share "
            "the target's tokenizer"
        )
    draft_setup = dataclasses.replace(
        setup,
        source=source,
        model_config=draft_config,
        quantization=pick_quantization(None, source, draft_config, setup.device),
    )
    model = load_rank_model(config, draft_setup, None)
    return ModelRunner(model, config.cache.block_size, setup.dtype, setup.device)


def build_speculator(
    config: EngineConfig,
    setup: RankSetup,
    target: LlamaForCausalLM,
    draft: ModelRunner | None,
    num_blocks: int,
    max_model_len: int,
) -> Speculator | None:
    """Speculative decoding's state (None without it); a `draft` model gets its KV cache of
    `num_blocks` blocks (and decode graphs, as the target)."""
    if config.speculative is None:
        return None
    proposer = None
    if draft is not None:
        draft.allocate_kv_cache(num_blocks)
        max_len = min(max_model_len, draft.config.max_position_embeddings)
        if uses_graphs(config, setup):  # (catching up takes 1 or 2 tokens per sequence)
            draft.enable_decode_graphs(config.scheduler.max_num_seqs, max_len, 2)
        proposer = DraftModelProposer(
            draft, num_blocks, config.scheduler.max_num_batched_tokens, max_len
        )
    return Speculator(config.speculative, target, setup.device, proposer)


def num_kv_blocks(
    config: EngineConfig, runner: ModelRunner, setup: RankSetup, draft: ModelRunner | None = None
) -> int:
    """The configured count; else what fits in `gpu_memory_utilization` of the GPU once the
    weights, the largest step's activations (profiled) and the CUDA context are counted (and
    a `draft` model's cache, block for block beside the target's)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_cache_bytes_per_block(runner.config, cache.block_size, runner.kv_cache_dtype)
    if draft is not None:
        per_block += kv_cache_bytes_per_block(draft.config, cache.block_size, setup.dtype)
    if setup.device.type == "cuda":
        sched = config.scheduler
        # (with drafts, each sequence samples after every draft: that many more logits rows)
        peak = runner.profile_peak_bytes(
            min(sched.max_num_batched_tokens, setup.max_model_len),
            sched.max_num_seqs * graph_query_len(config),
        )
        free, total = torch.cuda.mem_get_info(setup.device)
        # Memory the CUDA context, libraries and other processes hold outside our allocator.
        outside = total - free - torch.cuda.memory_reserved(setup.device)
        weights = torch.cuda.memory_allocated(setup.device)
        budget = total * cache.gpu_memory_utilization - outside - weights - peak - _GRAPHS_RESERVE
        budget -= prefill_graph_bytes(
            runner.model, prefill_graph_tokens(config, setup), runner.dtype
        )
        logger.info(
            "memory: %.2f GiB total, weights %.2f GiB, largest step %.2f GiB, outside "
            "torch %.2f GiB; %.2f GiB for the KV cache at utilization %.2f",
            total / _GIB,
            weights / _GIB,
            peak / _GIB,
            outside / _GIB,
            budget / _GIB,
            cache.gpu_memory_utilization,
        )
    else:
        budget = cache.cpu_kv_cache_gib * _GIB
    num_blocks = int(budget // per_block)
    if num_blocks < 2:
        raise ValueError(
            f"no memory is left for the KV cache (budget {budget / _GIB:.2f} GiB); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return num_blocks


def _attention_factory(backend: str) -> AttentionFactory:
    """Builds each layer's attention for the chosen backend (Triton imported only when used)."""
    layer_class: type[AttentionLayer] = TorchAttention
    if backend == "triton":
        from kvfleet.engine.attention.triton_attention import TritonAttention

        layer_class = TritonAttention

    def make(config: ModelConfig) -> AttentionLayer:
        scalar = config.query_pre_attn_scalar
        return layer_class(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.sliding_window,
            scale=None if scalar is None else scalar**-0.5,
            softcap=config.attn_logit_softcap,
        )

    return make


def _pick_attention_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device; use torch on the CPU")
    return backend


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return torch.device(device)


def _pick_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)  # type: ignore[no-any-return]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's {limit} positions"
        )
    return config.max_model_len
