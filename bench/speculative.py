"""`kvfleet bench speculative`: speculative decoding on an input-grounded task, against the same
engine without drafts, in one run.

The task: the model repeats a given document word for word (chat-rendered "Repeat the
following text exactly" over one of the documents below), greedy, so the drafted output must
equal the plain output (checked). `--batch-size 1` runs the documents one request at a time
(latency: each request alone on the GPU); a larger batch runs that many requests at once,
documents cycled (throughput, where the adaptive draft count has to keep the cost of drafts
below their gain). A model without a tokenizer (dummy weights) gets random prompts of the same
length: its drafts are rarely kept, which measures what speculation costs when it fails.

Each run has a process of its own (neither inherits the other's heap, threads or allocator
state, nor the order). Reports output tokens/s of both runs, the speedup, the drafts verified
and kept, the mean acceptance length (tokens a drafted step emits per request), and where the
outputs differ, how many did and from which token on (in bfloat16 the verification's matmul
shapes differ from plain decoding's, so rounding may flip a near-tie; float32 shows exactness).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfleet.bench.ceilings import sync
from kvfleet.bench.report import emit
from kvfleet.engine.core.request import Request
from kvfleet.engine.core.stats import SpecDecodeStats
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.spec_decode.speculator import Speculator
from kvfleet.engine.worker.setup import freeze_startup_heap

DOCUMENTS = [
    "Kubernetes schedules containers onto nodes. A Deployment keeps a set of identical pods "
    "running and replaces those that fail; a Service gives them one stable address. Each pod "
    "gets its own IP address, and the containers in a pod share it. Labels select which pods a "
    "Service sends traffic to. When a node runs out of memory, the kubelet evicts pods in order "
    "of their quality of service class, best effort first. A rolling update replaces pods a few "
    "at a time, so the Service always has ready endpoints. Readiness probes decide when a pod "
    "may receive traffic; liveness probes decide when it must be restarted.",
    "A paged KV cache stores the keys and values of every token in fixed-size blocks, so a "
    "sequence's cache need not be contiguous. A block table maps each sequence's logical "
    "blocks to physical ones. When two requests share a prefix, they can share the blocks that "
    "hold it, and a new request whose prompt starts with a cached prefix skips computing it. "
    "Blocks are freed when a request finishes; cached blocks stay until they are evicted, least "
    "recently used first. The scheduler admits new requests while free blocks remain and "
    "preempts the newest request when a running one needs a block and none is free.",
    "The lighthouse keeper climbed the stairs every evening at dusk. There were one hundred and "
    "twelve steps, and he counted each of them, as his father had. At the top he trimmed the "
    "wick, polished the great lens, and lit the lamp. Ships passing in the night saw the beam "
    "sweep across the water every ten seconds. In winter the wind howled around the tower and "
    "the glass rattled in its frame, but the light never went out. In the morning he wrote the "
    "weather in the logbook, the ships he had seen, and the hour the lamp was put out.",
    "To bake bread, mix five hundred grams of flour with ten grams of salt and seven grams of "
    "yeast. Add three hundred and fifty millilitres of warm water and stir until a rough dough "
    "forms. Knead it on a floured table for ten minutes, until it is smooth and springs back "
    "when pressed. Leave it in a covered bowl for an hour, until it has doubled in size. Shape "
    "it into a loaf, let it rise for another forty minutes, and bake it at two hundred and "
    "twenty degrees for thirty minutes, until the crust is brown and the base sounds hollow.",
]


def run(args: argparse.Namespace) -> int:
    speculative = json.loads(args.speculative_config)
    plain = _in_own_process(args, None)
    drafted = _in_own_process(args, speculative)
    plain_outputs, drafted_outputs = plain.pop("outputs"), drafted.pop("outputs")
    diverged = [
        next((i for i, (a, b) in enumerate(zip(p, d, strict=False)) if a != b), min(len(p), len(d)))
        for p, d in zip(plain_outputs, drafted_outputs, strict=True)
        if p != d
    ]
    result: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "output_len": args.output_len,
        "speculative_config": speculative,
        "plain": plain,
        "speculative": drafted,
        "speedup": round(drafted["output_tok_per_s"] / plain["output_tok_per_s"], 3),
        "same_output": not diverged,
        "requests": len(plain_outputs),
        "diverged_requests": len(diverged),
        "first_divergence": sorted(diverged)[:8],  # (token index in the output)
    }
    emit(result, args.json)
    return 0 if not diverged else 1


def _in_own_process(args: argparse.Namespace, speculative: dict[str, Any] | None) -> Any:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure, (args, speculative))


def _measure(args: argparse.Namespace, speculative: dict[str, Any] | None) -> dict[str, Any]:
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_size, 1),
        gpu_memory_utilization=args.gpu_memory_utilization,
        speculative_config=speculative,
    )
    freeze_startup_heap()
    engine = llm.engine
    prompts = _prompts(llm, args)
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=engine.tokenizer is None
    )
    batches = [[p] for p in prompts] if args.batch_size == 1 else [prompts]
    llm.generate(batches[0], params)  # warm-up (and the adaptive fit's first steps)
    stats = engine.scheduler.spec_decode_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    speculator = engine.speculator
    proposed = (speculator.num_proposals, speculator.propose_seconds) if speculator else (0, 0.0)
    trace = _trace(speculator) if speculator else None
    first_met = _count_kernel_variants()
    outputs: list[list[int]] = []
    seconds = 0.0
    for batch in batches * args.repeats:
        sync(engine.device)
        began = time.perf_counter()
        done = llm.generate(batch, params)
        sync(engine.device)
        seconds += time.perf_counter() - began
        outputs += [list(o.outputs[0].token_ids) for o in done]
    run = SpecDecodeStats(
        stats.num_drafts - before[0],
        stats.num_draft_tokens - before[1],
        stats.num_accepted_tokens - before[2],
    )
    num_tokens = sum(len(o) for o in outputs)
    measured = {
        "output_tokens": num_tokens,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(num_tokens / seconds, 1),
        "drafted_steps": run.num_drafts,
        "draft_tokens": run.num_draft_tokens,
        "accepted_tokens": run.num_accepted_tokens,
        "acceptance_rate": round(run.num_accepted_tokens / run.num_draft_tokens, 3)
        if run.num_draft_tokens
        else None,
        "mean_acceptance_length": round(run.mean_acceptance_length, 3) if run.num_drafts else None,
        # steps drafts were asked for (some came back or not), and the seconds spent proposing
        "proposal_steps": speculator.num_proposals - proposed[0] if speculator else 0,
        "propose_seconds": round(speculator.propose_seconds - proposed[1], 3) if speculator else 0,
        **(trace() if trace else {}),
        # Triton kernel variants first met after the warm-up (each compiled or loaded from
        # the cache mid-run: the measured time includes it)
        "kernel_variants_first_met": first_met,
        "outputs": outputs,
    }
    engine.close()
    return measured


def _trace(speculator: Speculator) -> Callable[[], dict[str, Any]]:
    """Records as the engine runs; the returned function gives the report: each proposal
    (running requests, drafts asked of each, requests that got some, milliseconds; the first
    32), each step drafts were asked for (tokens, milliseconds; the first 32) and the median
    timed step without them (None when every step asked for drafts)."""
    proposals: list[list[Any]] = []
    drafted_steps: list[list[float]] = []
    plain: list[float] = []
    propose, observe_cost = speculator.propose, speculator.observe_cost

    def timed_propose(running: Sequence[Request], num_drafts: int) -> Any:
        before = (speculator.num_proposals, time.perf_counter())
        drafts = propose(running, num_drafts)
        if speculator.num_proposals > before[0] and len(proposals) < 32:
            ms = round(1e3 * (time.perf_counter() - before[1]), 2)
            proposals.append([len(running), num_drafts, len(drafts), ms])
        return drafts

    def timed_cost(num_tokens: int, seconds: float, drafted: bool) -> None:
        observe_cost(num_tokens, seconds, drafted)
        if not drafted:
            plain.append(seconds)
        elif len(drafted_steps) < 32:
            drafted_steps.append([num_tokens, round(1e3 * seconds, 2)])

    def report() -> dict[str, Any]:
        median = round(1e3 * statistics.median(plain), 2) if plain else None
        return {
            "proposals": proposals,
            "drafted_steps_ms": drafted_steps,
            "plain_step_ms_median": median,
        }

    speculator.propose = timed_propose  # type: ignore[method-assign]
    speculator.observe_cost = timed_cost  # type: ignore[method-assign]
    return report


def _count_kernel_variants() -> list[str]:
    """The names of the Triton kernels that get a new variant from now on, filled in as they do
    (none are counted without Triton)."""
    met: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - (Triton ships with CUDA torch)
        return met

    def hook(*, fn: Any, **_: Any) -> bool:
        met.append(fn.name)
        return False  # (compile it)

    knobs.runtime.jit_cache_hook = hook
    return met


def _prompts(llm: LLM, args: argparse.Namespace) -> list[Any]:
    """`args.batch_size` prompts (at least one per document at batch 1): the repeat task, or
    random token ids of the same lengths without a tokenizer."""
    count = max(args.batch_size, len(DOCUMENTS) if args.batch_size == 1 else 0)
    documents = [DOCUMENTS[i % len(DOCUMENTS)] for i in range(count)]
    tokenizer = llm.tokenizer
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size
        return [
            torch.randint(100, vocab - 100, (320,), generator=generator).tolist() for _ in documents
        ]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Repeat the following text exactly:\n\n{doc}"}],
                True,
            ),
            add_special_tokens=False,
        )
        for doc in documents
    ]
