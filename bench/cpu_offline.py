"""Offline throughput of SmolLM2 on the CPU: kvfleet's engine beside transformers `generate`.

    .venv/bin/python bench/cpu_offline.py --num-prompts 32 --output-len 128

Both run the same 32 chat prompts (greedy, exactly --output-len new tokens each) in one process.
Two floors, each over a ceiling measured in this run: bytes (every decode step streams all
weights once: output_len x weight bytes / copy bandwidth) and FLOPs (2 x parameters x every
token computed, prompt and output, over a large float32 matmul's rate; attention's share at
these lengths is under 5% and left out). The larger is the floor.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from kvfleet.bench.report import emit

TOPICS = [
    "the water cycle",
    "how vaccines work",
    "the history of the printing press",
    "black holes",
    "photosynthesis",
    "the French revolution",
    "how a CPU cache works",
    "plate tectonics",
    "the rules of chess",
    "why the sky is blue",
    "compound interest",
    "the immune system",
]


def make_prompts(tokenizer: Any, num: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Please be thorough and give examples." * (i % 4)
        messages = [{"role": "user", "content": f"Explain {topic} to a student.{detail}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def memory_bandwidth_gbs() -> float:
    """Bytes read + written per second by a large float32 copy (median of 5)."""
    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    median = sorted(times[1:])[2]
    return 2 * src.numel() * 4 / median / 1e9


def matmul_gflops() -> float:
    """float32 FLOP/s of a 2048^3 matmul (median of 5)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / sorted(times[1:])[2] / 1e9


def run_kvfleet(prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    llm = LLM("smollm2", dtype="float32", max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    ttfts = sorted(o.metrics.time_to_first_token or 0.0 for o in outputs)
    return {"seconds": elapsed, "ttft_p50_s": ttfts[len(ttfts) // 2]}


def run_transformers(prompts: list[list[int]], output_len: int, model: Any) -> dict[str, float]:
    width = max(len(p) for p in prompts)
    pad = 2
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(
            input_ids[:2],
            attention_mask=attention_mask[:2],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            pad_token_id=pad,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
        )
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return {"seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfleet.engine.loader import model_cache

    gguf = (
        model_cache.ModelCache(model_cache.kvfleet_home())
        .fetch(model_cache.BUILTIN_MODELS["smollm2"], progress=False)[0]
        .path
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = make_prompts(tokenizer, args.num_prompts)
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    num_params = sum(p.numel() for p in hf_model.parameters())
    bandwidth, gflops = memory_bandwidth_gbs(), matmul_gflops()
    total_tokens = args.num_prompts * args.output_len
    computed_tokens = sum(map(len, prompts)) + total_tokens
    bytes_floor = args.output_len * weight_bytes / (bandwidth * 1e9)
    flops_floor = 2 * num_params * computed_tokens / (gflops * 1e9)
    floor = max(bytes_floor, flops_floor)

    ours = run_kvfleet(prompts, args.output_len)
    theirs = run_transformers(prompts, args.output_len, hf_model)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
        "torch": torch.__version__,
        "num_prompts": args.num_prompts,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "output_len": args.output_len,
        "memory_bandwidth_GBps": round(bandwidth, 1),
        "matmul_GFLOPs": round(gflops, 1),
        "weight_bytes": weight_bytes,
        "bytes_floor_s": round(bytes_floor, 2),
        "flops_floor_s": round(flops_floor, 2),
        "floor_s": round(floor, 2),
        "kvfleet_s": round(ours["seconds"], 2),
        "kvfleet_tok_per_s": round(total_tokens / ours["seconds"], 1),
        "kvfleet_pct_of_floor": round(100 * floor / ours["seconds"], 1),
        "kvfleet_ttft_p50_s": round(ours["ttft_p50_s"], 2),
        "transformers_s": round(theirs["seconds"], 2),
        "transformers_tok_per_s": round(total_tokens / theirs["seconds"], 1),
        "transformers_pct_of_floor": round(100 * floor / theirs["seconds"], 1),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
