"""The peer: the same workloads through Hugging Face transformers, with the ceilings, in one call.

    python3 bench/hf_peer.py --model llama-3-8b --part decode batch --json peer.json

- `decode`: batch-1 `generate` with a static cache (which `generate` compiles), greedy,
  --decode-output-len new tokens after --decode-input-len; ms per token is
  (t(N new) - t(1 new)) / (N - 1), median of --repeats, after warm-up (compilation).
- `batch`: `generate_batch` (continuous batching, `attn_implementation="paged|sdpa"`) on the
  offline workload of `kvfleet bench throughput` (same seeded random prompts), greedy.

The model is built from kvfleet's shipped config with random weights (the same shapes as
`--load-format dummy`). Ceilings (copy bandwidth, bf16 matmul) are measured in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from kvfleet.bench.ceilings import measure_ceilings
from kvfleet.bench.report import emit
from kvfleet.bench.workload import parse_range, random_workload
from kvfleet.engine.loader.source import CONFIGS_DIR


def build_model(name: str, attn_implementation: str) -> Any:
    import transformers

    values = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, torch_dtype=torch.bfloat16, attn_implementation=attn_implementation
        )
    return model.eval()


def decode(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = build_model(args.model, "sdpa")
    # NOTE: generate compiles the forward itself (CUDA graphs included) when the cache is
    # static; wrapping it in torch.compile again breaks its graph replays.
    prompt = torch.randint(
        100, model.config.vocab_size - 100, (1, args.decode_input_len), device="cuda"
    )

    def timed(new_tokens: int) -> float:
        config = GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
        )
        torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompt, generation_config=config)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    for _ in range(2):  # compilation, graph capture
        timed(args.decode_output_len)
        timed(1)
    one = sorted(timed(1) for _ in range(args.repeats))[args.repeats // 2]
    full = sorted(timed(args.decode_output_len) for _ in range(args.repeats))[args.repeats // 2]
    per_token = (full - one) / (args.decode_output_len - 1)
    return {
        "hf_decode_ms_per_token": round(per_token * 1e3, 3),
        "hf_ttft_ms": round(one * 1e3, 2),
        "decode_input_len": args.decode_input_len,
        "decode_output_len": args.decode_output_len,
    }


def batch(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = build_model(args.model, "paged|sdpa")
    workload = random_workload(
        args.num_prompts,
        parse_range(args.input_len),
        parse_range(args.output_len),
        model.config.vocab_size,
        seed=args.seed,
    )
    max_new = max(workload.output_lens)
    config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=-1,  # never produced: every request runs to max_new_tokens
        pad_token_id=0,
    )
    # NOTE: not under inference_mode: generate_batch runs its loop in a thread of its own.
    torch.cuda.synchronize()
    began = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "hf_batch_elapsed_s": round(elapsed, 3),
        "hf_batch_output_tokens": generated,
        "hf_batch_requests_returned": len(outputs),
        "hf_batch_output_tok_per_s": round(generated / elapsed, 1),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "note": "output tokens counted from what generate_batch returned",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help="a shipped config")
    parser.add_argument("--part", nargs="+", choices=["decode", "batch"], default=["decode"])
    parser.add_argument("--decode-input-len", type=int, default=128)
    parser.add_argument("--decode-output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="128:1024")
    parser.add_argument("--output-len", default="256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    import transformers

    result: dict[str, Any] = {
        "peer": f"transformers {transformers.__version__}",
        "model": args.model,
        "device": torch.cuda.get_device_name(),
    }
    ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    result["copy_GBps"] = round(ceilings.copy_gbps, 1)
    result["matmul_TFLOPs"] = round(ceilings.matmul_tflops, 1)
    for part in args.part:
        try:
            result |= decode(args) if part == "decode" else batch(args)
        except Exception as exc:  # report the peer's failure, keep the other part
            result[f"{part}_error"] = f"{type(exc).__name__}: {exc}"
        gc.collect()  # the part's model and caches, before the next part allocates its own
        torch.cuda.empty_cache()
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
