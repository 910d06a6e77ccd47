"""The device side of an engine, built in order: the tensor-parallel workers and their group,
the model, the LoRA slots, the runner, the draft model, the KV cache (sized from what is left),
the decode graphs and the speculator. What each rank sets up alike is in setup.py."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.lora.manager import LoRAManager
from kvfleet.engine.parallel.group import TPGroup
from kvfleet.engine.parallel.partition import TPPlan
from kvfleet.engine.spec_decode.speculator import Speculator
from kvfleet.engine.worker.model_runner import ModelRunner
from kvfleet.engine.worker.process import WorkerPool, free_port
from kvfleet.engine.worker.setup import (
    RankSetup,
    build_speculator,
    enable_peer_all_reduce,
    graph_query_len,
    join_group,
    load_draft,
    load_rank_model,
    num_kv_blocks,
    prefill_graph_tokens,
    uses_graphs,
)
from kvfleet.engine.worker.step_tail_warm_up import warm_up_step_tail
from kvfleet.engine.worker.swap_space import SwapSpace

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0


@dataclass
class DeviceSide:
    runner: ModelRunner
    num_blocks: int  # KV cache blocks (every rank holds as many)
    lora: LoRAManager | None
    speculator: Speculator | None
    tp: TPGroup | None  # rank 0's group, with tensor parallelism
    workers: WorkerPool | None  # the other ranks' processes

    def close(self) -> None:
        """Stop the tensor-parallel workers, every rank leaving the group together (nothing to
        do without them). Idempotent."""
        if self.workers is None or self.tp is None:
            return
        logger.info("stopping %d tensor-parallel workers", len(self.workers.processes))
        tp, self.tp = self.tp, None
        if self.workers.dead is None:
            try:
                self.runner.release_graphs()
                self.workers.expect_exit()  # (they exit on the stop signal, before stop())
                tp.broadcast_stop()
                # NOTE: a guard only: the workers leave the group at the same time
                closing = threading.Thread(target=tp.close, name="kvfleet-tp-close", daemon=True)
                closing.start()
                closing.join(_CLOSE_TIMEOUT_S)
                if closing.is_alive():
                    logger.warning("the tensor-parallel group did not close; leaving it")
            except RuntimeError:
                logger.warning("a tensor-parallel worker did not take the stop signal")
        self.workers.stop()
        logger.info("tensor-parallel workers stopped")


def build_device_side(config: EngineConfig, setup: RankSetup) -> DeviceSide:
    workers: WorkerPool | None = None
    tp: TPGroup | None = None
    size = config.tensor_parallel_size
    if size > 1:
        TPPlan.build(setup.model_config, 0, size)  # fail before spawning
        port = free_port()
        workers = WorkerPool(config, size, port)
        workers.start()
        tp = workers.run_while_alive(lambda: join_group(setup, 0, size, port))
    model = load_rank_model(config, setup, tp)
    if tp is not None and workers is not None:
        group = tp
        workers.run_while_alive(lambda: enable_peer_all_reduce(config, setup, group))
    lora = None
    if config.lora.enable_lora:
        # NOTE: before the KV cache is sized, so the slots count as weights.
        settings = config.lora
        lora = LoRAManager(
            model,
            settings.max_loras,
            settings.max_cpu_loras or settings.max_loras,
            settings.max_lora_rank,
            use_triton=setup.attention_backend == "triton",
        )
        for name, path in settings.lora_modules:
            lora.add(name, path)
    runner = ModelRunner(
        model, config.cache.block_size, setup.dtype, setup.device, lora, setup.kv_cache_dtype
    )
    # NOTE: the draft model before the KV cache is sized: its weights and its own cache (as
    # many blocks as the target's) count.
    draft = load_draft(config, setup) if config.speculative else None
    num_blocks = num_kv_blocks(config, runner, setup, draft)
    if tp is not None and workers is not None:
        group, own = tp, num_blocks  # every rank holds the same blocks
        num_blocks = workers.run_while_alive(lambda: group.min_int(own))
    runner.allocate_kv_cache(num_blocks)
    swap_bytes = int(config.cache.swap_space_gib * 2**30)
    # (no more blocks than the cache's own: on the CPU they share one memory)
    swap_blocks = min(swap_bytes // SwapSpace.bytes_per_block(runner.kv_caches), num_blocks)
    # NOTE: one rank's copies only, and a draft model's cache holds no swapped blocks.
    if swap_blocks and (tp is not None or config.speculative):
        logger.info("swap space unused with tensor parallelism or speculative decoding")
    elif swap_blocks:
        runner.swap_space = SwapSpace(runner.kv_caches, swap_blocks)
    if uses_graphs(config, setup):  # (every rank captures the same graphs, NCCL included)
        runner.enable_decode_graphs(
            config.scheduler.max_num_seqs, setup.max_model_len, graph_query_len(config)
        )
    if tokens := prefill_graph_tokens(config, setup):
        runner.enable_prefill_graphs(tokens)
    warm_up_step_tail(runner)
    if config.cache.calculate_kv_scales:  # (after the warm-up and profiling steps)
        model.calibrate_kv_scales()
    speculator = build_speculator(config, setup, model, draft, num_blocks, setup.max_model_len)
    return DeviceSide(runner, num_blocks, lora, speculator, tp, workers)
